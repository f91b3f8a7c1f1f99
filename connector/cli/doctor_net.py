"""The network half of `doctor` (connector.cli.doctor): the side-channel address and its ports, the running
engines' HTTP servers (UCX's settings and the engines' processes: connector.cli.doctor_proc)."""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from connector.cli.probe import DOCTOR_ENGINE, SideChannelAnswer, http_get, port_state, probe_side_channel
from connector.core.errors import ConfigError
from connector.core.layout import ParallelLayout
from connector.protocol.addressing import PrefillAddress, side_channel_port
from connector.transport.handshake import is_loopback
from connector.protocol.handshake import layout_wire
from connector.protocol.messages import Hello

FAIL, WARN, OK = "FAIL", "warn", "ok"
Doctor = Any
"""connector.cli.doctor.Doctor (its settings, tokens, models, urls, args, add()): not imported, it imports us."""
WILDCARDS = ("0.0.0.0", "::", "")


def node_ip() -> str:
    """The address vLLM reports for this node when VLLM_HOST_IP is unset (its get_ip: the outgoing interface)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 80))  # (no packet is sent)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def probe_hello(doc: Doctor) -> Hello:
    """What the probe introduces itself as: decode rank (0, 0) of the decode layout, decode's model when known."""
    model = doc.models.get("decode")
    tp, pp = doc.ranks("decode")
    stages = ParallelLayout.build(model.num_layers, tp, pp).stages if model is not None and pp <= model.num_layers \
        else ()
    return Hello(role="decode", engine_id=DOCTOR_ENGINE, pp_rank=0, tp_rank=0, pp_size=pp, tp_size=tp,
                 fingerprint=model.fingerprint() if model is not None else "unknown", block_size=doc.args.block_size,
                 agent_name=DOCTOR_ENGINE, stages=[tuple(s) for s in stages],
                 layout=layout_wire(model) if model is not None else [],
                 num_layers=model.num_layers if model is not None else 0)


def check_side_channel(doc: Doctor) -> None:
    pre = doc.settings["prefill"]
    host = pre.side_channel_host or os.environ.get("VLLM_HOST_IP") or ""
    if not host:
        url_host = urlsplit(doc.urls["prefill"] or "").hostname
        host = url_host or node_ip()
        doc.add(OK, "side_channel_host", f"unset: vLLM's address for prefill's node (VLLM_HOST_IP or its detection; "
                                         f"here {host})")
    if host in WILDCARDS:
        doc.add(FAIL, "side_channel_host", f"{host!r} is no address decode can connect to: set side_channel_host to "
                                           f"the address of prefill's node that decode reaches")
        return
    if doc.multi_node and is_loopback(host):
        doc.add(FAIL, "side_channel_host", f"{host} is loopback, and decode runs on another node: set "
                                           f"side_channel_host (or VLLM_HOST_IP) to prefill's address on the network "
                                           f"decode reaches")
        return
    try:
        socket.getaddrinfo(host, None)
    except OSError as exc:
        doc.add(FAIL, "side_channel_host", f"{host!r} does not resolve ({exc.strerror}): give an address or a name "
                                           f"decode can resolve")
        return
    given = doc.args.side_channel
    address = PrefillAddress(host, pre.side_channel_port)
    if given:
        try:
            told = PrefillAddress.parse(given)
        except ConfigError as exc:
            doc.add(FAIL, "--side-channel", str(exc))
            return
        if told.port != address.port or (told.host != address.host and not doc.multi_node):
            http = _http_port_owner(doc, told)
            if http:
                doc.add(FAIL, "--side-channel", f"{told} is {http}, not a side channel: you gave an HTTP port where "
                                                f"the side channel goes; prefill's side channel is side_channel_port "
                                                f"{address.port} ({address}): give the router --prefill URL,{address}")
                return
            doc.add(FAIL, "side-channel address", f"the router gives decode {told}, but prefill rank (0, 0) listens "
                                                  f"on {address}: give the router --prefill URL,{address}")
        address = told
    tp, pp = doc.ranks("prefill")
    ports = [side_channel_port(address.port, (r // tp, r % tp), tp) for r in range(tp * pp)]
    span = f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])
    for side, url in doc.urls.items():
        parts = urlsplit(url or "")
        if parts.port in ports and (side == "prefill" or not doc.multi_node):
            doc.add(FAIL, "side_channel_port", f"{parts.port} is also {side}'s HTTP port ({url}): decode would send "
                                               f"the side-channel handshake to vLLM's OpenAI server (and read its "
                                               f"HTTP answer as a 1,213,486,160-byte frame); set side_channel_port "
                                               f"to a range of {len(ports)} free port(s) apart from the HTTP ports, "
                                               f"e.g. 5600, and give the router --prefill URL,HOST:THAT_PORT")
            return
    _check_ports(doc, address, ports, span)


def _http_port_owner(doc: Doctor, address: PrefillAddress) -> str:
    """What `address` is when it is an engine's HTTP port ("prefill's HTTP server (URL)", from --prefill-url or
    --decode-url, or "an HTTP server" when a probe gets an HTTP answer there); "" when it is none."""
    for side, url in doc.urls.items():
        parts = urlsplit(url or "")
        if parts.port == address.port and (parts.hostname == address.host or not doc.multi_node):
            return f"{side}'s HTTP server ({url})"
    answer = probe_side_channel(address.host, address.port, probe_hello(doc), "", doc.args.timeout)
    return f"an HTTP server ({answer.detail})" if answer.kind == "http" else ""


def port_list(ports: list[int]) -> str:
    """Ports as runs: [5600, 5601, 5602, 5605] -> "5600-5602, 5605"."""
    runs: list[list[int]] = []
    for port in sorted(ports):
        if runs and port == runs[-1][-1] + 1:
            runs[-1].append(port)
        else:
            runs.append([port])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _check_ports(doc: Doctor, address: PrefillAddress, ports: list[int], span: str) -> None:
    running = doc.urls["prefill"] is not None and http_get(doc.urls["prefill"] + "/health", doc.args.timeout)[0] == 200
    token = doc.tokens.get("decode") or ""
    answers = {port: probe_side_channel(address.host, port, probe_hello(doc), token, doc.args.timeout)
               for port in ports}
    kinds = {a.kind for a in answers.values()}
    if kinds <= {"unreachable"}:
        if running:
            doc.add(FAIL, "side channel", f"nothing answers at {address.host}:{span}, yet prefill's HTTP server runs: "
                                          f"its side_channel_port differs, or the engine behind the prefill URL is "
                                          f"not kv_producer ({answers[ports[0]].detail})")
            return
        states = {port: port_state(address.host, port) for port in ports}
        busy = [p for p, s in states.items() if s == "in use"]
        if busy:
            doc.add(FAIL, "side_channel_port", f"port(s) {busy} on {address.host} are in use by another process: stop "
                                               f"it (`ss -ltnp 'sport = :{busy[0]}'`) or choose another range")
        elif "not local" in states.values():
            doc.add(OK if doc.multi_node else WARN, "side_channel_port",
                    f"{address.host} is not an address of this machine: its ports {span} were not checked (run "
                    f"doctor on prefill's node to check them)")
        else:
            doc.add(OK, "side_channel_port", f"{span} free on {address.host} (prefill ranks listen there once started)")
        return
    groups: dict[tuple[str, str, str], list[int]] = {}
    for port, answer in answers.items():  # one line per kind of answer, naming its ports (not eight alike)
        groups.setdefault((answer.kind, answer.detail.replace(str(port), "{port}"), answer.auth), []).append(port)
    for (kind, detail, auth), same in groups.items():
        where = f"side channel{'s' if len(same) > 1 else ''} {address.host}:{port_list(same)}"
        shown = detail if len(same) == 1 else detail.replace("{port}", "<each port>")
        _report(doc, where, SideChannelAnswer(kind, shown.replace("{port}", str(same[0])), auth), running)


def _report(doc: Doctor, what: str, answer: SideChannelAnswer, running: bool) -> None:
    kind = answer.kind
    if kind == "connector":
        doc.add(OK, what, f"a SparseKVConnector side channel ({answer.detail})")
        if answer.auth != "ok":
            doc.add(FAIL, f"{what} auth", answer.auth)
        elif doc.tokens.get("decode"):
            doc.add(OK, f"{what} auth", "prefill proved it holds decode's auth_token")
    elif kind in ("refused", "mismatch") and "fingerprint" in answer.detail and "decode" not in doc.models:
        doc.add(OK, what, "a SparseKVConnector side channel (its model was not compared: give --decode-model)")
    elif kind == "mismatch":
        doc.add(FAIL, what, f"a SparseKVConnector side channel decode cannot pair with: {answer.detail}")
    elif kind == "refused":
        doc.add(FAIL, what, f"refused decode's handshake: {answer.detail}")
    elif kind == "http":
        port = what.rpartition(":")[2]
        owner = next((f"{side}'s HTTP port ({url})" for side, url in doc.urls.items()
                      if url and str(urlsplit(url).port) == port), "an HTTP port")
        doc.add(FAIL, what, f"this is an HTTP server, not a side channel: you gave {owner} where prefill's side "
                            f"channel goes; the side channel is prefill's side_channel_port: give decode (the "
                            f"router's --prefill URL,HOST:PORT) that port ({answer.detail})")
    elif kind == "unreachable":
        doc.add(FAIL if running else WARN, what, f"nothing answers ({answer.detail}): the prefill rank of this port "
                                                 f"is not up")
    elif kind == "tls":
        doc.add(FAIL, what, f"TLS failed ({answer.detail}): decode's tls_ca_file must hold the CA of prefill's "
                            f"certificate, issued for this host")
    else:
        doc.add(FAIL, what, f"something else listens there ({answer.kind}: {answer.detail}): not a SparseKVConnector "
                            f"side channel; choose another side_channel_port or stop it")


def check_engines(doc: Doctor) -> None:
    served = {}
    for side, url in doc.urls.items():
        if not url:
            continue
        status, reason = http_get(url + "/health", doc.args.timeout)
        if status != 200:
            doc.add(FAIL, f"{side} engine", f"{url}/health answered {status or 'nothing'} ({reason[:200]}): start it, "
                                            f"or fix --{side}-url")
            continue
        doc.add(OK, f"{side} engine", f"{url} is healthy")
        status, text = http_get(url + "/metrics", doc.args.timeout)
        if status == 200 and "vllm:sparse_kv_" not in text:
            doc.add(WARN, f"{side} engine", f"{url}/metrics has no vllm:sparse_kv_ counters: does this engine run "
                                            f"SparseKVConnector? (its --kv-transfer-config)")
        status, text = http_get(url + "/v1/models", doc.args.timeout)
        if status == 200:
            served[side] = sorted(m.get("id", "") for m in _json(text).get("data", []))
    if len(served) == 2 and served["prefill"] != served["decode"]:
        doc.add(WARN, "served models", f"prefill serves {served['prefill']}, decode {served['decode']}: the router "
                                       f"sends one model name to both")


def _json(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
