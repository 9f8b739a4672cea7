"""Groups of quantized modules, their ranking by damage, and the recipe variant keeping the worst in BF16 (pure)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

By = Literal["block", "module"]
WHOLE = "(every group)"  # the fully quantized model's own row: what all groups together do
RANK_BY = "quality/kld_mean"
# A decoder block: the first `<name>.<index>` in a module's path (model.layers.3 in model.layers.3.mlp.up_proj).
_BLOCK = re.compile(r"^(.*?\.\d+)(?=\.|$)")
# Recipe fields naming a file or directory relative to the recipe (the others are inline or builtin).
PATH_FIELDS = (("model", "source"), ("calibration", "source"), ("quality", "corpus"), ("evals", "include_path"))


@dataclass(frozen=True)
class LayerGroup:
    name: str
    modules: tuple[str, ...]  # quantized modules, full names

    @property
    def ignore_pattern(self) -> str:
        """The group in llm-compressor's `ignore` syntax: its own name, or `re:` over everything under it."""
        if self.modules == (self.name,):
            return self.name
        return f"re:{re.escape(self.name)}\\..*"


@dataclass(frozen=True)
class GroupDamage:
    group: LayerGroup
    metrics: dict[str, float]  # quality/* of the baseline with only this group quantized


def layer_groups(quantized: Sequence[str], by: By) -> list[LayerGroup]:
    """Quantized module names -> groups in model order: each decoder block, or (`module`) each child of a block
    that holds quantized modules (self_attn, mlp). A module outside the blocks is a group of its own."""
    members: dict[str, list[str]] = {}
    for name in quantized:
        block = _BLOCK.match(name)
        if block is None:
            key = name
        elif by == "block":
            key = block.group(1)
        else:
            child = name[block.end() + 1 :].split(".", 1)[0]
            key = f"{block.group(1)}.{child}" if child else name
        members.setdefault(key, []).append(name)
    return [LayerGroup(key, tuple(names)) for key, names in members.items()]


def ranked(damage: Sequence[GroupDamage]) -> list[GroupDamage]:
    """Most damaging first (KL mean from the baseline); ties keep model order."""
    return sorted(damage, key=lambda item: -item.metrics[RANK_BY])


def rank_correlation(first: Mapping[str, int], second: Mapping[str, int]) -> float:
    """Spearman's rank correlation of two rankings (group -> rank) of the same groups."""
    from scipy.stats import spearmanr

    if first.keys() != second.keys():
        raise ValueError("the two rankings rank different groups")
    groups = sorted(first)
    return float(spearmanr([first[g] for g in groups], [second[g] for g in groups]).statistic)


def kept_variant_name(variant: str, keep: int, by: By) -> str:
    return f"{variant}-keep{keep}" + ("-modules" if by == "module" else "")


def recipe_keeping(
    text: str, source_dir: Path, target_dir: Path, variant: Mapping[str, Any], name: str, kept: Sequence[LayerGroup]
) -> str:
    """The recipe `text` (read from `source_dir`) as it should read in `target_dir`, with one more variant: a copy
    of `variant` (its raw mapping) named `name` that also ignores the `kept` groups. Comments and layout are kept:
    the new variant is inserted after the last one, and relative paths are rewritten for the new directory."""
    params = dict(variant.get("params") or {})
    ignore = list(params.get("ignore", ["lm_head"]))
    params["ignore"] = ignore + [group.ignore_pattern for group in kept if group.ignore_pattern not in ignore]
    return recipe_with_variant(
        text, source_dir, target_dir, {"name": name, "method": variant["method"], "params": params}
    )


def mixed_variant(name: str, parts: Sequence[tuple[Mapping[str, Any], Sequence[LayerGroup]]]) -> dict[str, Any]:
    """A `mixed` variant (quantlab.quantize.mixed) named `name`: each (raw variant, groups) part quantizes those
    groups' modules in that variant's method and params; everything else stays BF16 (lm_head included)."""
    formats = []
    for variant, groups in parts:
        params = {key: value for key, value in (variant.get("params") or {}).items() if key != "ignore"}
        part: dict[str, Any] = {"method": variant["method"]} | ({"params": params} if params else {})
        formats.append(part | {"modules": target_patterns(groups)})
    return {"name": name, "method": "mixed", "params": {"formats": formats}}


def target_patterns(groups: Sequence[LayerGroup]) -> list[str]:
    """llm-compressor targets matching the groups' quantized modules and nothing else (a `re:` over a whole block
    would also give its attention module a scheme of its own): groups that differ only in their last name segment
    and hold the same modules below it share one pattern, e.g. ``re:model\\.layers\\.(?:0|11)\\.(?:mlp\\.up_proj|...)$``."""
    shared: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    exact = []
    for group in groups:
        if group.modules == (group.name,):
            exact.append(group.name)
            continue
        stem, _, last = group.name.rpartition(".")
        tails = tuple(module[len(group.name) + 1 :] for module in group.modules)
        shared.setdefault((stem, tails), []).append(last)
    patterns = []
    for (stem, tails), names in shared.items():
        head = f"{re.escape(stem)}\\." if stem else ""
        patterns.append(f"re:{head}(?:{'|'.join(map(re.escape, names))})\\.(?:{'|'.join(map(re.escape, tails))})$")
    return patterns + exact


def recipe_with_variant(text: str, source_dir: Path, target_dir: Path, added: Mapping[str, Any]) -> str:
    """The recipe `text` (read from `source_dir`) as it should read in `target_dir`, with the variant `added` (a raw
    mapping) inserted after the last one: comments and layout kept, relative paths rewritten for the new directory."""
    root = yaml.compose(text)
    edits = [_rebased(node, source_dir, target_dir) for node in _path_nodes(root)]
    variants = _value_node(root, "variants")
    if not isinstance(variants, yaml.SequenceNode) or variants.flow_style or not variants.value:
        raise ValueError("the recipe's variants are not a block list: cannot insert the new variant")
    first = variants.value[0].start_mark
    line_start = text.rfind("\n", 0, first.index) + 1
    dash = text.rfind("-", line_start, first.index) - line_start  # where this recipe puts its items' dashes
    entry = yaml.safe_dump([dict(added)], sort_keys=False, default_flow_style=False, width=1000).splitlines()
    head = " " * dash + "-" + " " * (first.column - dash - 1) + entry[0][2:]
    lines = "\n".join([head] + [" " * first.column + line[2:] for line in entry[1:]])
    end = _line_end(text, variants.value[-1].end_mark.index)
    edits.append((end, end, "\n" + lines))
    for start, stop, replacement in sorted((e for e in edits if e is not None), reverse=True):
        text = text[:start] + replacement + text[stop:]
    return text


def _line_end(text: str, index: int) -> int:
    """The end of the last non-blank content before `index`'s trailing blank lines and comments."""
    return len(text[:index].rstrip())


def _value_node(mapping: yaml.Node | None, key: str) -> yaml.Node | None:
    if not isinstance(mapping, yaml.MappingNode):
        return None
    return next((value for k, value in mapping.value if getattr(k, "value", None) == key), None)


def _path_nodes(root: yaml.Node) -> list[yaml.ScalarNode]:
    nodes = [_value_node(_value_node(root, section), key) for section, key in PATH_FIELDS]
    return [node for node in nodes if isinstance(node, yaml.ScalarNode)]


def _rebased(node: yaml.ScalarNode, source_dir: Path, target_dir: Path) -> tuple[int, int, str] | None:
    """An edit replacing a relative path that exists beside the recipe by the same place seen from `target_dir`
    (a hub id or a builtin source does not exist as a path and is left as is)."""
    value = node.value
    if "://" in value or ":" in value.split("/", 1)[0] or Path(value).is_absolute():
        return None
    if not (source_dir / value).exists():
        return None
    moved = os.path.relpath((source_dir / value).resolve(), target_dir.resolve())
    if moved == value:
        return None
    return node.start_mark.index, node.end_mark.index, yaml.safe_dump(moved, default_style=None).splitlines()[0]
