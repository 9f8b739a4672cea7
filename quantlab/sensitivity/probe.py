"""The measurement: the baseline and the fully quantized model side by side in memory; each group's quantized
modules are swapped into the baseline in turn and the result compared, token by token, with the baseline's stored
reference pass (the sweep's own, computed once). Finished groups are kept in the cache as they finish, so an
interrupted run resumes where it stopped and a repeated one recomputes nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantlab import cache
from quantlab.quantize import METHODS
from quantlab.recipe import LoadedRecipe
from quantlab.sensitivity.groups import WHOLE, By, GroupDamage, LayerGroup, layer_groups

FORMAT = 2  # of the kept groups below and of how they are measured; part of the key
GROUPS_FILE = "groups.json"
DAMAGE_FILE = "damage.jsonl"
Progress = Callable[[str, int, int], None]  # (what is happening, groups done, groups in all; 0 when not known yet)


class CannotIsolate(ValueError):
    """The method changed modules outside the groups (e.g. AWQ's norms with --by module)."""


@dataclass(frozen=True)
class SensitivityJob:
    loaded: LoadedRecipe
    variant: str
    by: By
    rounded: bool  # swap in the modules of a round-to-nearest copy in the variant's format, not its own checkpoint's
    cache_root: Path
    force: bool = False  # measure every group again

    @property
    def rounding(self) -> str:
        """How the swapped-in modules were quantized, as the output says it."""
        method = self.loaded.recipe.variant(self.variant).method
        if METHODS[method].rounding_is_the_method:
            return f"{method} itself (data-free round-to-nearest)"
        if self.rounded:
            return f"round-to-nearest in {method}'s format, without its calibration (an approximation: --rounded)"
        return f"{method} itself, from the variant's own checkpoint"


@dataclass(frozen=True)
class Sensitivity:
    groups: list[GroupDamage]  # in model order
    whole: dict[str, float]  # every group quantized at once: the variant's own quality/* figures
    computed: int  # groups measured by this call; the others were kept from an earlier or interrupted one
    key: str


def sensitivity_key(job: SensitivityJob) -> str:
    """Content hash of everything that decides the figures."""
    from quantlab.models import checkpoint_identity, resolve_source
    from quantlab.stages.quantize import rounded_identity

    recipe = job.loaded.recipe
    source = resolve_source(recipe.model, job.loaded.path.parent)
    variant = recipe.variant(job.variant)
    quantized = (
        rounded_identity(source, variant) if job.rounded else checkpoint_identity(source, variant, recipe.calibration)
    )
    return cache.cache_key(
        {
            "format": FORMAT,
            "quantized": quantized,
            "baseline": checkpoint_identity(source, recipe.variant(recipe.baseline), recipe.calibration),
            "quality": recipe.quality.model_dump(),
            "runtime": recipe.runtime.model_dump(),
            "by": job.by,
        }
    )


def measure_sensitivity(job: SensitivityJob, progress: Progress = lambda what, done, total: None) -> Sensitivity:
    key = sensitivity_key(job)
    kept = _Kept(job.cache_root / "sensitivity" / key)
    if job.force:
        kept.clear()
    groups, done = kept.groups(), kept.damage()
    if groups is not None and {group.name for group in groups} | {WHOLE} <= done.keys():
        return Sensitivity([GroupDamage(g, done[g.name]) for g in groups], done[WHOLE], 0, key)
    computed = 0
    baseline, quantized, reference_dir = _load_models(job, progress)
    from quantlab.evaluate.reference import compare_tokens

    if groups is None:
        names = [name for name, module in quantized.named_modules() if hasattr(module, "quantization_scheme")]
        groups = layer_groups(names, job.by)
        if outside := changed_outside(baseline, quantized, groups):
            raise CannotIsolate(
                f"{job.variant}'s method also changed {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}, "
                f"outside every group --by {job.by} makes: its groups cannot be measured apart (use --by block)"
            )
        kept.keep_groups(groups)
    total = len(groups) + 1
    if WHOLE not in done:
        progress("every group at once", len(done), total)
        done[WHOLE] = kept.keep(WHOLE, compare_tokens(quantized, reference_dir).metrics())
    for group in groups:
        if group.name not in done:
            progress(group.name, len(done), total)
            with _swapped_in(baseline, quantized, group):
                done[group.name] = kept.keep(group.name, compare_tokens(baseline, reference_dir).metrics())
            computed += 1
    progress("done", total, total)
    return Sensitivity([GroupDamage(g, done[g.name]) for g in groups], done[WHOLE], computed, key)


def _load_models(job: SensitivityJob, progress: Progress):
    """(the baseline, the quantized model, the baseline's reference pass): checkpoints and reference from the
    cache when a sweep (or an earlier call) made them, made and kept there otherwise."""
    import torch

    from quantlab.jobs import VariantJob
    from quantlab.models import load_checkpoint, materialize, pick_device, pick_dtype, resolve_source
    from quantlab.stages.evaluate import token_damage
    from quantlab.stages.quantize import quantize_variant, rounded_variant

    recipe, recipe_dir = job.loaded.recipe, job.loaded.path.parent
    device = pick_device(recipe.runtime)
    dtype = pick_dtype(recipe.runtime, device)
    progress("prepare model", 0, 0)
    source = materialize(resolve_source(recipe.model, recipe_dir), job.cache_root)
    progress(f"baseline checkpoint and reference pass ({recipe.baseline})", 0, 0)
    base = recipe.variant(recipe.baseline)
    base_checkpoint = quantize_variant(source, base, recipe.calibration, recipe_dir, job.cache_root, device)
    baseline, tokenizer = load_checkpoint(base_checkpoint.path, dtype, device)
    as_baseline = VariantJob(job.loaded, recipe.baseline, job.cache_root, None)
    baseline_pass = token_damage(baseline, tokenizer, recipe.quality, recipe_dir, as_baseline, base_checkpoint.key)
    if baseline_pass.reference_dir is None:  # quality.enabled is false: validated before, said here too
        raise ValueError("sensitivity compares against the baseline's reference pass: quality.enabled must be true")
    variant = recipe.variant(job.variant)
    progress(f"quantized checkpoint ({job.rounding})", 0, 0)
    if job.rounded:
        checkpoint = rounded_variant(source, variant, job.cache_root, device)
    else:
        checkpoint = quantize_variant(source, variant, recipe.calibration, recipe_dir, job.cache_root, device)
    quantized, _ = load_checkpoint(checkpoint.path, dtype, device)
    # compressed-tensors decompresses a checkpoint loaded for CPU in a hook on the model's first forward pass:
    # its modules swapped into the baseline one by one would never fire it, and would meet compressed weights.
    with torch.inference_mode():
        quantized(input_ids=torch.zeros((1, 2), dtype=torch.int64, device=quantized.device), use_cache=False)
    return baseline, quantized, Path(baseline_pass.reference_dir)


class _swapped_in:  # noqa: N801 - used as a context manager, named as one
    """The group's whole module (a decoder block, its attention, ...) of `quantized` in `baseline`'s place while
    inside, the baseline's own back after: the whole module, norms included, since a calibrating method may have
    rescaled a norm into the layers it feeds (AWQ, SmoothQuant)."""

    def __init__(self, baseline, quantized, group: LayerGroup) -> None:
        self.baseline, self.quantized, self.name = baseline, quantized, group.name
        self.original = baseline.get_submodule(group.name)

    def __enter__(self) -> None:
        self.baseline.set_submodule(self.name, self.quantized.get_submodule(self.name))

    def __exit__(self, *exc: object) -> None:
        self.baseline.set_submodule(self.name, self.original)


def changed_outside(baseline, quantized, groups: list[LayerGroup]) -> list[str]:
    """Modules outside every group whose own parameters the quantized model changed (a norm AWQ or SmoothQuant
    rescaled into layers of a group): swapped without them, a group would not compute what the method made."""
    import torch

    units = tuple(group.name for group in groups)
    changed = []
    for name, module in quantized.named_modules():
        if any(name == unit or name.startswith(f"{unit}.") for unit in units):
            continue
        before = dict(baseline.get_submodule(name).named_parameters(recurse=False))
        if any(not torch.equal(value, before[key]) for key, value in module.named_parameters(recurse=False)):
            changed.append(name)
    return changed


class _Kept:
    """A sensitivity's finished groups in the cache: the group list once, then one line per finished group,
    flushed to disk as it finishes (a torn last line, from a crash mid-write, is measured again)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def clear(self) -> None:
        for name in (GROUPS_FILE, DAMAGE_FILE):
            (self.root / name).unlink(missing_ok=True)

    def groups(self) -> list[LayerGroup] | None:
        try:
            data = json.loads((self.root / GROUPS_FILE).read_text())
        except (OSError, ValueError):
            return None
        return [LayerGroup(item["name"], tuple(item["modules"])) for item in data]

    def keep_groups(self, groups: list[LayerGroup]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / DAMAGE_FILE).unlink(missing_ok=True)  # lines of another group list would not belong
        staging = self.root / f".{GROUPS_FILE}.{os.getpid()}"
        staging.write_text(json.dumps([{"name": g.name, "modules": list(g.modules)} for g in groups], indent=1))
        staging.replace(self.root / GROUPS_FILE)  # whole or absent

    def damage(self) -> dict[str, dict[str, float]]:
        found: dict[str, dict[str, float]] = {}
        try:
            lines = (self.root / DAMAGE_FILE).read_text().splitlines()
        except OSError:
            return found
        for line in lines:
            try:
                item = json.loads(line)
                found[item["group"]] = {key: float(value) for key, value in item["metrics"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        return found

    def keep(self, group: str, metrics: dict[str, float]) -> dict[str, float]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / DAMAGE_FILE, "a", encoding="utf-8") as file:
            file.write(json.dumps({"group": group, "metrics": metrics}) + "\n")
            file.flush()
            os.fsync(file.fileno())
        return metrics
