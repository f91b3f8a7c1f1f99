"""`python -m connector ...` and the `sparse-kv-connector` script: a thin argparse front end.

  main            the subcommands and their dispatch
  args            arguments every subcommand shares, and a side's layout parsed
  checks          command-line input checks in one place (ranges, one-line parse errors)
  demo            `demo` and `bench` over the simulated ranks (connector.sim)
  yardsticks      what good looks like next to each number demo and bench print, and their verdicts
  bench_pd        `bench-pd`: argument checks and output for connector.pd.bench
  serve_local     `serve-local`: a prefill, a decode and a router on this machine (connector.pd.local)
  doctor          `doctor`: what would break a pair, checked before traffic
  doctor_net      doctor's network half: the side-channel address and ports, the engines' HTTP servers
  doctor_proc     doctor's process half: which process serves each engine URL, and its UCX environment
  probe           what doctor asks a side channel (a handshake that stops before anything is registered)
  keygen          `keygen`: a prefill key pair
  settings        `settings`: every kv_connector_extra_config key, from the settings struct"""

from connector.cli.main import main

__all__ = ["main"]
