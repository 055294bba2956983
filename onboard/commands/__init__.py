"""One module per `onboard` command, each `add_arguments(parser)` and `run(args) -> Exit`: argument
parsing and printing only; the work is done by the stage packages below (and agents/ for new-model).
onboard/cli.py builds the parser from them and turns exceptions into exit codes."""
