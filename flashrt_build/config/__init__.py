"""What to build: the config, checked before any work.

    schema.py        the typed Hydra schema, one dataclass per group (quant's in quant.py)
    compose.py       composing the shipped configs without the CLI
    hydra_errors.py  Hydra's composition errors as the tool's one line, the value as it was given
    command_line.py  the command line composed before Hydra runs anything
    naming.py        the output folder's name, the same from the CLI and compose()
    shipped.py       where the shipped configs and the C++ sources are, installed or not
    keys.py          keys the schema lacks, each with the closest valid key
    problems.py      the one collector of a config's problems, raised together
    spec.py          a composed config resolved into a typed `BuildSpec`, a resolver per group
    module.py        the `module` group: name, targets, methods, checkpoint, served files, imports
    compiler.py      the compile: compiler, temp dir, quant recipe, Inductor options (those that may name code too)
    llm.py           what causal_lm reads from a save_pretrained directory's config.json
    inputs.py        each entry point's inputs, dynamic dims, value ranges, constant kwargs
    quant.py         a quantization recipe: its schema, rules (a method's own), targets, error bounds
    targets.py       what a config may run (the allow-list) and where that code comes from
    sources.py       under an allow-list, whether a value came from the command line or a config file
    remote_code.py   a checkpoint directory's own code: never run under an allow-list, nor read
    paths.py         the output folder derived and checked (writable, replaceable); config dir; TMPDIR
    files.py         every file a build reads, as the config names them
    toolchain.py     which C++ compiler a config means, whether it compiles, the -march it takes

Imports no torch (the command line decides a build is up to date without it)
and nothing else of flashrt_build but `errors`, `artifact` and the runtime's
torch-free modules.
"""
