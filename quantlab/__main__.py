from quantlab.cli import main

main()
