"""`python -m connector doctor`: what would break a prefill/decode pair, checked before traffic. Given the two
`--kv-transfer-config` JSONs (and optionally the models, the layouts, the running engines' URLs), one line per check,
`ok`, `warn` or `FAIL`, each failure with its fix; exit code 0 when nothing failed, 2 otherwise.

Checked: the connector and the roles; every extra-config key and type; the auth token (both sides or neither, the
same one, readable where it comes from a file or a variable); TLS files; the side-channel host (not 0.0.0.0, not
loopback when decode runs on another node) and its ports (not prefill's HTTP port; free before prefill starts,
answering as a SparseKVConnector side channel once it runs, with the token checked by a handshake that stops before
anything is registered); the engines' HTTP servers; UCX's settings for the network; the two models' fingerprints and
the transfer plan between the two layouts; on the engines' host, which process serves each URL (swapped URLs) and
the engines' own UCX environment (connector.cli.doctor_proc). Identical lines about several things print once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from connector.cli.args import parse_side
from connector.cli.checks import float_in, int_in
from connector.core.errors import CliError, ConfigError, ConnectorError
from connector.core.describe import layout_difference
from connector.transport.handshake import is_loopback

FAIL, WARN, OK = "FAIL", "warn", "ok"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class Line:
    level: str
    what: str
    text: str

    def __str__(self) -> str:
        return f"{self.level:<4}  {self.what}: {self.text}"


def add_subcommand(subs: Any) -> None:
    p = subs.add_parser("doctor", help="check a prefill/decode pair's --kv-transfer-config (and running engines) "
                                       "before traffic: one line per check, exit code 0 or 2")
    for side in ("prefill", "decode"):
        p.add_argument(f"--{side}", required=True, metavar="JSON|@FILE",
                       help=f"{side}'s --kv-transfer-config (the JSON, or @ and a file holding it)")
        p.add_argument(f"--{side}-model", metavar="MODEL",
                       help=f"{side}'s model: preset, config.json or its folder (to compare fingerprints)")
        p.add_argument(f"--{side}-layout", default="tp=1,pp=1", metavar="tp=T,pp=P[,layers=a:b:c]",
                       help=f"{side}'s --tensor-parallel-size and --pipeline-parallel-size")
        p.add_argument(f"--{side}-url", metavar="URL", help=f"{side}'s HTTP server, if it runs (e.g. "
                                                            f"http://10.0.0.5:{8100 if side == 'prefill' else 8200})")
    p.add_argument("--side-channel", metavar="HOST:PORT",
                   help="the prefill side-channel address the router gives decode (examples/proxy.py's --prefill "
                        "URL,HOST:PORT; default: prefill's side_channel_host:side_channel_port)")
    p.add_argument("--multi-node", action="store_true",
                   help="decode runs on another node than prefill (implied when the two URLs' hosts differ)")
    p.add_argument("--network", choices=["tcp", "rdma"], default="tcp",
                   help="with --multi-node: the network the KV crosses (UCX's transports)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="both engines' --kv-cache-dtype")
    p.add_argument("--block-size", type=int_in(1, 1024), default=16,
                   help="the engines' --block-size (the side-channel probe introduces itself with it)")
    p.add_argument("--timeout", type=float_in(0, 120, lo_open=True), default=5.0, help="seconds per network probe")
    p.set_defaults(run=run)


def load_json(text: str, flag: str) -> dict[str, Any]:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise CliError(f"{flag} {text}: cannot read it: {exc.strerror}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{flag}: not JSON ({exc.msg} at character {exc.pos}): give vllm serve's "
                       f"--kv-transfer-config value, e.g. '{{\"kv_connector\":\"SparseKVConnector\",...}}'") from None
    if not isinstance(value, dict):
        raise CliError(f"{flag}: a JSON object is needed, got {type(value).__name__}")
    return value


class Doctor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config = {side: load_json(getattr(args, side), f"--{side}") for side in ROLES}
        self.lines: list[Line] = []
        self.settings: dict[str, Any] = {}
        self.tokens: dict[str, str | None] = {}
        self.models: dict[str, Any] = {}
        self.urls = {side: getattr(args, f"{side}_url") for side in ROLES}
        hosts = {urlsplit(u).hostname for u in self.urls.values() if u}
        self.multi_node = args.multi_node or (len(hosts) == 2 and not all(is_loopback(h or "") for h in hosts))

    def add(self, level: str, what: str, text: str) -> None:
        self.lines.append(Line(level, what, text))

    def run(self) -> list[Line]:
        from connector.cli.doctor_net import check_engines, check_side_channel
        from connector.cli.doctor_proc import check_ucx

        self.check_roles()
        self.check_settings()
        if len(self.settings) == 2:
            self.check_tokens()
            self.check_prefill_keys()
            self.check_tls()
            self.check_models()
            check_side_channel(self)
            check_engines(self)
        check_ucx(self)
        return grouped(self.lines)

    # ---- the configs ------------------------------------------------------------------------------------------
    def check_roles(self) -> None:
        got = {side: self.config[side].get("kv_role") for side in ROLES}
        names = {side: self.config[side].get("kv_connector") for side in ROLES}
        for side, name in names.items():
            if name != "SparseKVConnector":
                self.add(FAIL, f"{side} kv_connector", f"{name!r}: set \"kv_connector\": \"SparseKVConnector\"")
        if got == {"prefill": "kv_consumer", "decode": "kv_producer"}:
            self.add(FAIL, "roles", "swapped: the prefill config says kv_consumer and the decode config kv_producer: "
                                    "give prefill kv_producer and decode kv_consumer (or swap the router's URLs)")
            return
        bad = False
        for side, want in ROLES.items():
            if got[side] not in (want, "kv_both"):  # kv_both: each request's kv_transfer_params decide
                bad = True
                self.add(FAIL, f"{side} kv_role", f"{got[side]!r}: set \"kv_role\": \"{want}\" (or \"kv_both\") "
                                                   f"on {side}")
        if not bad:
            self.add(OK, "roles", f"prefill {got['prefill']}, decode {got['decode']}")
        policy = self.config["decode"].get("kv_load_failure_policy", "fail")
        self.add(OK, "decode kv_load_failure_policy",
                 f"{policy!r}: a request whose KV does not arrive " +
                 ("is prefilled again on decode (slower, but answered)" if policy == "recompute"
                  else "ends with an error (the client retries; 'recompute' prefills it on decode instead)"))

    def check_settings(self) -> None:
        from connector.vllm.config import ConnectorSettings

        for side in ROLES:
            try:
                self.settings[side] = ConnectorSettings.from_extra_config(
                    self.config[side].get("kv_connector_extra_config"))
                self.add(OK, f"{side} kv_connector_extra_config", "every key and value is valid")
            except ConfigError as exc:
                self.add(FAIL, f"{side} kv_connector_extra_config", str(exc).removeprefix("SparseKVConnector: "))

    def check_tokens(self) -> None:
        for side, s in self.settings.items():
            try:
                self.tokens[side] = s.token()
            except ConfigError as exc:
                level = WARN if self.multi_node else FAIL  # (a file or variable of another node)
                self.add(level, f"{side} auth token", f"{str(exc).removeprefix('SparseKVConnector: ')}"
                                                      f"{' (here; it is read on the engine node)' if level == WARN else ''}")
                self.tokens[side] = None
        have = {side: bool(t) or (t is None) for side, t in self.tokens.items()}
        if have["prefill"] != have["decode"]:
            one, other = ("prefill", "decode") if have["prefill"] else ("decode", "prefill")
            self.add(FAIL, "auth_token", f"auth_token differs between prefill and decode: {one} has one, {other} "
                                         f"none: set the same token on both (auth_token_file or auth_token_env)")
        elif not have["prefill"]:
            self.add(WARN if self.multi_node else OK, "auth_token",
                     "none on either side: anyone who reaches prefill's side channel can register as decode and "
                     "receive KV" + ("; set one on both (openssl rand -hex 32 > FILE, auth_token_file)"
                                     if self.multi_node else " (fine on one machine)"))
        elif None not in self.tokens.values() and self.tokens["prefill"] != self.tokens["decode"]:
            self.add(FAIL, "auth_token", "auth_token differs between prefill and decode: give both the same one")
        else:
            self.add(OK, "auth_token", "set on both sides" + ("" if None in self.tokens.values() else ", the same"))
        for side, s in self.settings.items():
            if s.auth_token:
                self.add(WARN, f"{side} auth_token", "written in the config, so vLLM's 'non-default args' log line "
                                                     "prints it: use auth_token_file or auth_token_env")

    def check_prefill_keys(self) -> None:
        from connector.protocol.auth import engine_public_key, key_fingerprint

        try:
            key = self.settings["prefill"].prefill_key()
        except ConfigError as exc:
            self.add(WARN if self.multi_node else FAIL, "prefill prefill_key_file",
                     str(exc).removeprefix("SparseKVConnector: "))
            return
        try:
            trusted = self.settings["decode"].trusted_keys()
        except ConfigError as exc:
            self.add(FAIL, "decode trusted_prefill_keys", str(exc).removeprefix("SparseKVConnector: "))
            return
        public = engine_public_key(key) if key else b""
        if trusted and not key:
            self.add(FAIL, "prefill keys", "decode trusts only prefills with a key in trusted_prefill_keys, and "
                                           "prefill has no prefill_key_file: decode would refuse every handshake")
        elif trusted and public not in trusted:
            self.add(FAIL, "prefill keys", f"prefill's key {key_fingerprint(public)} is not in decode's "
                                           f"trusted_prefill_keys: add `python -m connector keygen --public FILE`'s "
                                           f"output for prefill's prefill_key_file")
        elif trusted:
            self.add(OK, "prefill keys", f"prefill signs its handshakes with {key_fingerprint(public)}, which decode "
                                         f"trusts")
        elif key:
            self.add(WARN, "prefill keys", "prefill signs its handshakes, but decode trusts any peer with the token "
                                           "as a prefill: add prefill's public key to decode's trusted_prefill_keys")
        elif self.multi_node:
            self.add(WARN, "prefill keys", "none: any holder of the auth token can pose as a prefill to a decode "
                                           "that a request points at it, and WRITE into decode's KV memory "
                                           "(README, Security: prefill_key_file, trusted_prefill_keys)")

    def check_tls(self) -> None:
        pre, dec = self.settings["prefill"], self.settings["decode"]
        for side, s in self.settings.items():
            for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
                path = getattr(s, name)
                if path and not os.access(path, os.R_OK):
                    self.add(WARN if self.multi_node else FAIL, f"{side} {name}", f"{path!r} cannot be read here")
        if bool(pre.tls_cert_file) != bool(pre.tls_key_file):
            self.add(FAIL, "prefill TLS", "set both tls_cert_file and tls_key_file, or neither")
        if pre.tls_cert_file and not dec.tls_ca_file:
            self.add(FAIL, "TLS", "prefill serves TLS but decode has no tls_ca_file: decode's handshake would fail; "
                                  "give decode the CA bundle of prefill's certificate")
        elif dec.tls_ca_file and not pre.tls_cert_file:
            self.add(FAIL, "TLS", "decode expects TLS (tls_ca_file) but prefill has no tls_cert_file")
        elif pre.tls_cert_file:
            self.add(OK, "TLS", "prefill serves the side channel over TLS, decode verifies it")
        elif self.multi_node:
            self.add(WARN, "TLS", "off: on a shared network an eavesdropper on the side channel learns decode's NIXL "
                                  "metadata (README, Security)")

    def check_models(self) -> None:
        from connector.core.hf_config import load_model
        from connector.core.plan import build_plan, check_plan

        for side in ROLES:
            spec = getattr(self.args, f"{side}_model")
            if spec:
                try:
                    self.models[side] = load_model(spec, self.args.kv_cache_dtype)
                except ConnectorError as exc:
                    self.add(FAIL, f"{side} model", str(exc))
        if len(self.models) < 2:
            if not any(line.what.endswith("model") and line.level == FAIL for line in self.lines):
                self.add(WARN, "model", "not compared: give --prefill-model and --decode-model (their config.json)")
            return
        pre, dec = self.models["prefill"], self.models["decode"]
        if pre.fingerprint() != dec.fingerprint():
            what = layout_difference(pre, dec, me="prefill", them="decode") or "the same pools, other sizes"
            self.add(FAIL, "model", f"the fingerprints differ ({pre.fingerprint()} vs {dec.fingerprint()}): {what}; "
                                    f"serve the same model, dtype and --kv-cache-dtype on both")
            return
        self.add(OK, "model", f"the same layout on both sides (fingerprint {pre.fingerprint()}, {pre.num_layers} "
                              f"layers, {sum(1 for p in pre.pools.values() if p.layers)} pool(s))")
        try:
            plan = build_plan(pre, parse_side(self.args.prefill_layout, pre, "--prefill-layout"),
                              parse_side(self.args.decode_layout, dec, "--decode-layout"))
            check_plan(plan)
            self.add(OK, "plan", f"prefill {self.args.prefill_layout} -> decode {self.args.decode_layout}: "
                                 f"{len(plan.routes)} routes, every (pool, layer, head) exactly once")
        except ConnectorError as exc:
            self.add(FAIL, "plan", str(exc))

    def ranks(self, side: str) -> tuple[int, int]:
        """(tp, pp) of a side's --layout (1, 1 when it does not parse: reported by the plan check)."""
        fields = dict(item.partition("=")[::2] for item in getattr(self.args, f"{side}_layout").split(","))
        try:
            return int(fields.get("tp", 1)), int(fields.get("pp", 1))
        except ValueError:
            return 1, 1


def grouped(lines: list[Line]) -> list[Line]:
    """Lines that say the same thing about several things, as one line naming them all (in first-seen order)."""
    whats: dict[tuple[str, str], list[str]] = {}
    for line in lines:
        whats.setdefault((line.level, line.text), []).append(line.what)
    return [Line(level, ", ".join(dict.fromkeys(what)), text) for (level, text), what in whats.items()]


def run(args: argparse.Namespace) -> int:
    lines = Doctor(args).run()
    for line in lines:
        print(line, flush=True)
    failed = sum(line.level == FAIL for line in lines)
    warned = sum(line.level == WARN for line in lines)
    print(f"{'FAILED' if failed else 'passed'}: {failed} failure(s), {warned} warning(s), {len(lines)} check(s)",
          file=sys.stderr if failed else sys.stdout)
    return 2 if failed else 0
