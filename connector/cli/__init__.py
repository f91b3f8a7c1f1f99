"""`python -m connector ...` and the `sparse-kv-connector` script: a thin argparse front end.

  main            the subcommands and their dispatch (demo, bench, bench-pd, serve-local: the lab's, by name)
  args            arguments every subcommand shares, and a side's layout parsed
  checks          command-line input checks in one place (ranges, one-line parse errors)
  doctor          `doctor`: what would break a pair, checked before traffic
  doctor_net      doctor's network half: the side-channel address and ports, the engines' HTTP servers
  doctor_proc     doctor's process half: which process serves each engine URL, and its UCX environment
  probe           what doctor asks a side channel (a handshake that stops before anything is registered)
  keygen          `keygen`: a prefill key pair
  settings        `settings`: every kv_connector_extra_config key, from the settings struct"""

from connector.cli.main import main

__all__ = ["main"]
