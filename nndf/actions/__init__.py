"""Actions of the CLI, one module each: `add_arguments(parser)` adds its own flags, `run(args)` returns Results."""
