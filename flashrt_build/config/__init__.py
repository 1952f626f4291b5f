"""What to build: the config, checked before any work.

    schema.py      the typed Hydra schema, one dataclass per group; unknown keys
    compose.py     composing the shipped configs without the CLI
    spec.py        a composed config resolved into a typed `BuildSpec`
    quant.py       a quantization recipe: its rules, targets and error bound
    paths.py       the paths a config names: writable, replaceable, listable; TMPDIR
    checkpoint.py  a checkpoint (a file, a save_pretrained directory): complete, readable
    files.py       every file a build reads, as the config names them
    compiler.py    which C++ compiler a config means, its version, the -march it takes

Imports no torch (the command line decides a build is up to date without it)
and nothing else of flashrt_build but `errors` and `artifact`.
"""
