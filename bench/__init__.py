"""Rill's load generator: seeded workloads against an OpenAI-compatible or a Rill/TGI-native server.

Run it as `python -m bench --help`; `bench/README.md` shows example commands.

Modules, in the order a run uses them:
- `workloads`: seeded prompts and output lengths, grouped into sessions (a chat is a session of turns);
  `repeat_texts`: the hand-written code and prose of the `repeat` workload;
- `client`: one streamed request per API flavour (native, OpenAI completions or chat), timed into a
  `RequestRecord`;
- `runner`: arrivals (Poisson, bursts or fixed concurrency), the duration bound, the progress bar;
- `stats`: percentiles and the summary of a run, and b/a ratios;
- `report` and `plots`: the printed tables, the JSON file, the PNGs;
- `cli`: the `run`, `sweep` and `compare` subcommands.

`python -m bench.suite` (`suite`, `peers`, `roofline`) starts the servers it compares through `harness` and
`servers`; the tests start theirs through `servers` too (start, wait until healthy, stop).
"""
