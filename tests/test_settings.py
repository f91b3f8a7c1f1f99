"""The operator's settings (`connector.vllm.config.ConnectorSettings`, from kv_connector_extra_config) and the engine
and transport configs they build stay in step: every config field is a setting of the same name (same default,
copied by the one generic conversion), derived from settings, or internal on purpose; every setting lands somewhere.
Pure: no vllm, no NIXL."""

from __future__ import annotations

import dataclasses

import pytest

from connector.engine.config import ReceiverConfig, SenderConfig, lost_source_hold_s
from connector.transport.limits import ServerLimits
from connector.transport.nixl.settings import TransportConfig
from connector.transport.side_channel import SideChannelConfig
from connector.vllm.config import LIMIT_KEYS, ConnectorSettings

CONFIGS = (SideChannelConfig, ServerLimits, SenderConfig, ReceiverConfig, TransportConfig)
SETTINGS = tuple(n for n in ConnectorSettings.__struct_fields__ if n != "limits") + tuple(sorted(LIMIT_KEYS))
"""Every setting by its name: the top-level keys and those under `limits` (names never repeat between the two)."""


def setting(settings: ConnectorSettings, name: str):
    return getattr(settings.limits if name in LIMIT_KEYS else settings, name)


def extra(name: str, value) -> dict:
    """kv_connector_extra_config setting `name` alone, where it belongs."""
    return {"limits": {name: value}} if name in LIMIT_KEYS else {name: value}

DERIVED = {
    ("SenderConfig", "host"): ("side_channel_host",),  # the worker resolves vLLM's own host when unset
    ("SenderConfig", "port"): ("side_channel_port",),  # plus the rank's offset (connector.protocol.addressing)
    ("SenderConfig", "side_channel"): (),
    ("ReceiverConfig", "side_channel"): (),
    ("SideChannelConfig", "limits"): (),
    ("SideChannelConfig", "prefill_key"): ("prefill_key_file",),
    ("SideChannelConfig", "trusted_keys"): ("trusted_prefill_keys",),
    ("ReceiverConfig", "staging_slot_bytes"): ("staging_slot_mb",),
    ("ReceiverConfig", "lost_source_hold_s"): ("tcp_user_timeout_s", "heartbeat_interval_s"),
    ("TransportConfig", "name"): (),  # unique per worker process
}
"""Config fields built from settings (or from other configs) rather than copied by name."""
INTERNAL = {
    ("ServerLimits", "auth_failure_delay_s"): "the cost of a guess; not a knob for operators",
    ("ServerLimits", "known_identities"): "bounds the guard's memory; far above any cluster's decode ranks",
    ("SenderConfig", "max_writes_per_destination"): "pipelining depth the engine was measured with",
    ("SenderConfig", "released_memory_s"): "how long finished ids are remembered",
    ("SenderConfig", "staging_ring_slots"): "staged chunks in flight per connection",
    ("SenderConfig", "stage_min_descriptors"): "when staging pays",
    ("SenderConfig", "stage_below_bytes"): "when staging pays, per memory type",
    ("SenderConfig", "record_timeline"): "the bench's timeline",
    ("ReceiverConfig", "stop_timeout_s"): "bounded wait for sources to confirm they stopped",
    ("TransportConfig", "post_threads"): "posting threads per transport",
    ("TransportConfig", "ucx_error_handling_mode"): "peer-failure detection stays on",
    ("TransportConfig", "unload_sweep_s"): "sweeps of NIXL's thread-pool UCX workers after unloads (issue 33)",
}
"""Config fields no operator sets, and why."""
ADAPTER = {"staging_mb": "the worker allocates the staging buffer itself (ConnectorSettings.staging_bytes)",
           "auth_token_file": "read by ConnectorSettings.token() into SideChannelConfig.auth_token "
                              "(tests/test_early_checks.py)",
           "auth_token_env": "the same, from the environment variable it names",
           "prefill_key_file": "read by ConnectorSettings.prefill_key() into SideChannelConfig.prefill_key",
           "trusted_prefill_keys": "hex text parsed by ConnectorSettings.trusted_keys() into SideChannelConfig."
                                   "trusted_keys (tests/test_prefill_keys.py)",
           "holding_step_interval_s": "the scheduler side's pacer (connector.vllm.idle_hold)",
           "require_transfer_secret": "the scheduler side's prefill half (connector.vllm.requests.secret_of)",
           "insecure_any_prefill": "checked at start by ConnectorSettings.check_trust (tests/test_secure_defaults.py)",
           "allowed_prefill_hosts": "the scheduler side's decode half (connector.vllm.requests.check_params)"}
"""Settings the vLLM adapter reads itself instead of handing them to a config."""


def fields_of(config_type: type) -> list[tuple[str, dataclasses.Field]]:
    return [(f.name, f) for f in dataclasses.fields(config_type)]


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("config_type", CONFIGS, ids=lambda t: t.__name__)
def test_every_config_field_is_a_setting_derived_or_internal(config_type):
    for name, _ in fields_of(config_type):
        key = (config_type.__name__, name)
        kinds = [name in SETTINGS, key in DERIVED, key in INTERNAL]
        assert sum(kinds) == 1, (f"{config_type.__name__}.{name}: add a ConnectorSettings field of that name (with "
                                 f"its default), or list it in DERIVED or INTERNAL here; kinds={kinds}")


def test_every_setting_reaches_a_config_or_the_adapter():
    copied = {name for t in CONFIGS for name, _ in fields_of(t)}
    derived = {s for sources in DERIVED.values() for s in sources}
    assert set(SETTINGS) - copied - derived - set(ADAPTER) == set()


@pytest.mark.parametrize("config_type", CONFIGS, ids=lambda t: t.__name__)
def test_a_setting_has_its_configs_default(config_type):
    defaults = ConnectorSettings()
    for name, f in fields_of(config_type):
        if name in SETTINGS and f.default is not dataclasses.MISSING:
            assert setting(defaults, name) == default_of(f), f"{config_type.__name__}.{name}"
    assert defaults.staging_slot_mb << 20 == ReceiverConfig().staging_slot_bytes
    assert lost_source_hold_s(defaults.tcp_user_timeout_s, defaults.heartbeat_interval_s) == \
        ReceiverConfig().lost_source_hold_s


def test_the_default_settings_build_the_default_configs():
    s = ConnectorSettings()
    assert s.side_channel() == SideChannelConfig()
    assert s.sender_config("127.0.0.1", 0) == SenderConfig()
    assert s.receiver_config() == ReceiverConfig()
    assert s.transport_config("agent") == TransportConfig("agent")


def changed(value):
    """Another valid value of the same type."""
    if isinstance(value, bool):
        return not value
    if value is None:
        raise AssertionError(f"no changed value for {value!r}")
    if isinstance(value, str):
        return value + "-x"
    if isinstance(value, float) and 0 < value < 1:
        return value / 2  # a share (layer_wake_cpu_share) stays within 0..1
    return value * 2 + 1


@pytest.mark.parametrize("name", [n for n in SETTINGS if n not in ADAPTER
                                  and not n.startswith("side_channel_") and n != "staging_slot_mb"])
def test_each_setting_reaches_its_config(name):
    """Set alone, a setting changes the field of its name in every config that has one, and nothing else there."""
    default = setting(ConnectorSettings(), name)
    value = 3.0 if default is None else changed(default)
    s = ConnectorSettings.from_extra_config(extra(name, value))
    built = {SideChannelConfig: s.side_channel(), ServerLimits: s.side_channel().limits,
             SenderConfig: s.sender_config("127.0.0.1", 0), ReceiverConfig: s.receiver_config(),
             TransportConfig: s.transport_config("agent")}
    defaults = {t: (TransportConfig("agent") if t is TransportConfig else t()) for t in CONFIGS}
    moved = {(t.__name__, f) for t in CONFIGS for f, _ in fields_of(t)
             if f not in ("side_channel", "limits") and getattr(built[t], f) != getattr(defaults[t], f)}
    homes = {(t.__name__, name) for t in CONFIGS if name in dict(fields_of(t))}
    assert homes and moved == homes | {key for key, src in DERIVED.items() if name in src}
    assert all(getattr(built[t], name) == value for t in CONFIGS if (t.__name__, name) in homes)


def test_limits_nest_under_one_key_and_the_old_flat_keys_still_work_with_a_warning(caplog):
    nested = ConnectorSettings.from_extra_config({"limits": {"max_connections": 7, "max_peer_agents": "9"}})
    assert nested.side_channel().limits.max_connections == 7 and nested.sender_config("h", 0).max_peer_agents == 9
    assert not caplog.records
    flat = ConnectorSettings.from_extra_config({"max_connections": 7, "limits": {"max_peer_agents": 9}})
    assert flat == nested
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "belong under \"limits\"" in caplog.text and "max_connections" in caplog.text


@pytest.mark.parametrize("given, says", [
    ({"limits": {"max_conections": 3}}, "unknown kv_connector_extra_config['limits'] key(s) ['max_conections']: "
                                        "'max_conections' (value 3): did you mean 'max_connections'?"),
    ({"limits": {"max_connections": 0}}, "kv_connector_extra_config['limits']['max_connections']=0 is refused"),
    ({"limits": {"max_connections": True}}, "kv_connector_extra_config['limits']['max_connections']=True is "
                                            "refused"),
    ({"limits": 5}, "kv_connector_extra_config['limits']=5 is refused: give an object"),
    ({"max_connections": 1, "limits": {"max_connections": 2}}, "sets ['max_connections'] both at the top level and "
                                                              "under 'limits'"),
    ({"max_handshakes": 0}, "kv_connector_extra_config['limits']['max_handshakes']=0 is refused"),
])
def test_a_bad_limit_is_refused_naming_where_it_is(given, says):
    from connector.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config(given)
    assert says in str(err.value)
