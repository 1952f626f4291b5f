"""A built artifact and running it: what a deployment needs (torch,
safetensors and the standard library: no Hydra, no OmegaConf), and what the
build's verification uses to load a package exactly as users do.

    load.py            `load(dir)`: digests checked, weights bound, a drop-in nn.Module
    runner.py          a package's models loaded: its custom operators' libraries first
    binding.py         what a load binds: weights checked, state in place or threaded
    call.py            one call of a method: inputs checked, state threaded, outputs rebuilt
    graphs.py          CUDA-graph replay of a method's calls, one graph per input shape
    threads.py         the CPU threads a method's calls run on
    generate.py        `generate(m, prompt, n)`: greedy or sampled, through prefill and decode; text in, text out
    sampling.py        how the next token is chosen: greedy, temperature, top-k, top-p, a repetition penalty
    tokenizer.py       the tokenizer a build copied beside its package, its files checked first
    sizes.py           a causal_lm package's sizes: a prompt held against them, refused by the keys a user sets
    manifest.py        reading, writing and checking manifest.json
    manifest.schema.json  its JSON Schema, written once
    schema.py          a validator for the part of JSON Schema it uses (no jsonschema needed)
    contract.py        what a load relies on, recorded in the package
    hashing.py         sha256 of files (whole, in chunks on every core) and of JSON values
    checkpoint.py      checkpoints compared with a package's tensors, laid out as it reads them
    reader.py          checkpoint files read: safetensors a chunk at a time, torch without unpickling
    formats.py         checkpoint files and save_pretrained directories, without torch
    dtypes.py          dtype names, aliases, safetensors codes, written once
    tempdir.py         the temp dir a package unpacks into, refused by name where it cannot hold one
    gpu.py             the GPU a package runs on: identity, architecture, TF32 policy; the device asked for

May import `artifact` and `errors` only. manifest.py, contract.py,
hashing.py, formats.py, schema.py, sizes.py, tempdir.py and dtypes.py import no torch: the build
key and the up-to-date check use them.
"""
