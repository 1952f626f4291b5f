"""Many builds in one Hydra multirun, locally or on a cluster.

    job.py            one job: checked, then built in a fresh process, recorded
    build_process.py  that process (`python -m flashrt_build.sweep.build_process`)
    summary.py        the Hydra callback: a table and sweep_summary.{json,md}
    gpus.py           one build per GPU at a time across processes

May import everything below it: `pipeline`, `cache`, `stages`, `runtime`,
`config`, `errors`.
"""
