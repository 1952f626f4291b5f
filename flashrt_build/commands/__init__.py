"""The commands besides the build, each also `python -m flashrt_build.NAME`:

    doctor.py   python -m flashrt_build.doctor: the toolchain check and canary build
    check.py    python -m flashrt_build.check: does a checkpoint fit a built package?
    repro.py    python -m flashrt_build.repro: rebuild a release, compare it member by member
    clean.py    python -m flashrt_build.store clean: prune the build store
    cpp.py      python -m flashrt_build.cpp --cmake-dir: where the C++ library's CMake project is
    generate.py python -m flashrt_build.generate OUT --prompt TEXT: text in, text out
    generate_options.py  generate's flags, each checked before anything is read
    text.py     generate's text in and out: the prompt's ids (its flags checked), the continuation printed
    chat_template.py  a tokenizer's chat template rendered for generate, in a bounded process
    chat.py     generate --interactive: a conversation, the KV cache kept between turns

May import anything of flashrt_build; nothing imports them but their shims and
`flashrt-build NAME` (`__main__.py`).
"""
