"""One module per command, above every package: the CLI parses, these do.

`resolve` and `preflight` are the one resolution (recipe + overrides + world size -> a frozen
`Resolved`) and the one pre-flight (resume point, data), both run before any process group
exists; `run` and its launcher, `plan`, `sample`, `export`, `bench` and `prepare` build on them.
"""
