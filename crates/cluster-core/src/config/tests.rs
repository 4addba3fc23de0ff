//! Tests of `ShardingConfig`: the reference's defaults, every environment variable, the value
//! syntaxes, the validation bounds and the derived values.

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

/// A lookup that knows only `vars`.
fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |name| vars.iter().find(|(var, _)| *var == name).map(|(_, value)| (*value).to_owned())
}

fn load(vars: &[(&str, &str)]) -> Result<ShardingConfig, ConfigError> {
    ShardingConfig::from_env_with(env(vars))
}

fn load_error(vars: &[(&str, &str)]) -> ConfigError {
    match load(vars) {
        Ok(config) => panic!("{vars:?} loaded as {config:?}"),
        Err(error) => error,
    }
}

fn groups(names: &[&str]) -> Vec<ShardGroup> {
    names.iter().map(|name| ShardGroup::from(*name)).collect()
}

fn capacity(limit: u32) -> Capacity {
    Capacity::bounded(limit).unwrap()
}

fn secs(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

fn millis(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

#[test]
fn defaults_are_the_reference_defaults() {
    let config = ShardingConfig::default();
    assert_eq!(config.runner_address, Some(RunnerAddress::new("localhost", 34431)));
    assert_eq!(config.runner_listen_address, None);
    assert_eq!(config.runner_shard_weight, RunnerWeight::ONE);
    assert_eq!(config.available_shard_groups, groups(&["default"]));
    assert_eq!(config.assigned_shard_groups, groups(&["default"]));
    assert_eq!(config.shards_per_group, 300);
    assert_eq!(config.shard_lock_refresh_interval, secs(10));
    assert_eq!(config.shard_lock_expiration, secs(35));
    assert!(!config.shard_lock_disable_advisory);
    assert!(config.preemptive_shutdown);
    assert_eq!(config.entity_mailbox_capacity, capacity(4096));
    assert!(!config.entity_mailbox_metrics);
    assert_eq!(config.max_resident_entities, capacity(10_000));
    assert_eq!(config.unprocessed_message_batch_size.get(), 1024);
    assert_eq!(config.entity_max_idle_time, Some(secs(60)));
    assert_eq!(config.entity_registration_timeout, secs(60));
    assert_eq!(config.entity_termination_timeout, secs(15));
    assert_eq!(config.entity_message_poll_interval, secs(10));
    assert_eq!(config.entity_reply_poll_interval, millis(200));
    assert_eq!(config.send_retry_interval, millis(100));
    assert_eq!(config.refresh_assignments_interval, secs(3));
    assert_eq!(config.runner_join_debounce, Duration::ZERO);
    assert_eq!(config.runner_health_check_interval, secs(60));
    assert_eq!(config.runner_health_check, RunnerHealthCheck::PingKnown);
    assert_eq!(config.runner_probe_interval, secs(1));
    assert_eq!(config.storage_read_timeout, secs(10));
    assert_eq!(config.storage_write_timeout, secs(10));
    assert!(config.simulate_remote_serialization);
    assert_eq!(config.validate(), Ok(()));
}

#[test]
fn an_empty_environment_gives_the_defaults() {
    assert_eq!(load(&[]), Ok(ShardingConfig::default()));
}

#[test]
fn empty_values_count_as_unset() {
    let vars: Vec<(&str, &str)> = ENV_VARS.iter().map(|var| (*var, "")).collect();
    assert_eq!(load(&vars), Ok(ShardingConfig::default()));
}

#[test]
fn from_env_reads_the_process_environment() {
    let from_process = ShardingConfig::from_env_with(|var| std::env::var(var).ok());
    assert_eq!(ShardingConfig::from_env(), from_process);
}

/// One variable set to one value, and the change it makes to the default configuration.
type EnvCase = (&'static str, &'static str, fn(&mut ShardingConfig));

const ENV_CASES: &[EnvCase] = &[
    ("HOST", "runner-1.internal", |c| {
        c.runner_address = Some(RunnerAddress::new("runner-1.internal", 34431));
    }),
    ("PORT", "4000", |c| c.runner_address = Some(RunnerAddress::new("localhost", 4000))),
    ("LISTEN_HOST", "0.0.0.0", |c| {
        c.runner_listen_address = Some(RunnerAddress::new("0.0.0.0", 34431));
    }),
    ("RUNNER_SHARD_WEIGHT", "3", |c| c.runner_shard_weight = RunnerWeight::new(3.0).unwrap()),
    ("AVAILABLE_SHARD_GROUPS", "default,tenant", |c| {
        c.available_shard_groups = groups(&["default", "tenant"]);
    }),
    // The only valid assignment with the default available groups is `default`; a repeated
    // group is harmless and shows that the variable is read.
    ("SHARD_GROUPS", "default,default", |c| {
        c.assigned_shard_groups = groups(&["default", "default"]);
    }),
    ("SHARDS_PER_GROUP", "64", |c| c.shards_per_group = 64),
    ("SHARD_LOCK_REFRESH_INTERVAL", "5 seconds", |c| c.shard_lock_refresh_interval = secs(5)),
    ("SHARD_LOCK_EXPIRATION", "1 minute", |c| c.shard_lock_expiration = secs(60)),
    ("SHARD_LOCK_DISABLE_ADVISORY", "true", |c| c.shard_lock_disable_advisory = true),
    ("ENTITY_MAILBOX_CAPACITY", "16", |c| c.entity_mailbox_capacity = capacity(16)),
    ("ENTITY_MAILBOX_METRICS", "yes", |c| c.entity_mailbox_metrics = true),
    ("MAX_RESIDENT_ENTITIES", "500", |c| c.max_resident_entities = capacity(500)),
    ("UNPROCESSED_MESSAGE_BATCH_SIZE", "32", |c| {
        c.unprocessed_message_batch_size = NonZeroU32::new(32).unwrap();
    }),
    ("ENTITY_MAX_IDLE_TIME", "Infinity", |c| c.entity_max_idle_time = None),
    ("ENTITY_REGISTRATION_TIMEOUT", "30 seconds", |c| c.entity_registration_timeout = secs(30)),
    ("ENTITY_TERMINATION_TIMEOUT", "2 seconds", |c| c.entity_termination_timeout = secs(2)),
    ("ENTITY_MESSAGE_POLL_INTERVAL", "1 second", |c| c.entity_message_poll_interval = secs(1)),
    ("ENTITY_REPLY_POLL_INTERVAL", "50 millis", |c| c.entity_reply_poll_interval = millis(50)),
    ("REFRESH_ASSIGNMENTS_INTERVAL", "7 seconds", |c| c.refresh_assignments_interval = secs(7)),
    ("RUNNER_JOIN_DEBOUNCE", "20 seconds", |c| c.runner_join_debounce = secs(20)),
    ("SEND_RETRY_INTERVAL", "250 millis", |c| c.send_retry_interval = millis(250)),
    ("RUNNER_HEALTH_CHECK_INTERVAL", "2 minutes", |c| {
        c.runner_health_check_interval = secs(120);
    }),
    ("RUNNER_HEALTH_CHECK", "heartbeat", |c| c.runner_health_check = RunnerHealthCheck::Heartbeat),
    ("RUNNER_PROBE_INTERVAL", "250 millis", |c| c.runner_probe_interval = millis(250)),
    ("STORAGE_READ_TIMEOUT", "3 seconds", |c| c.storage_read_timeout = secs(3)),
    ("STORAGE_WRITE_TIMEOUT", "4 seconds", |c| c.storage_write_timeout = secs(4)),
    ("SIMULATE_REMOTE_SERIALIZATION", "off", |c| c.simulate_remote_serialization = false),
    ("MESSAGE_RETENTION", "7 days", |c| c.message_retention = Some(secs(7 * 24 * 3600))),
    ("WORKFLOW_RETENTION", "30 days", |c| c.workflow_retention = Some(secs(30 * 24 * 3600))),
];

#[test]
fn every_variable_sets_its_field() {
    for (var, value, change) in ENV_CASES {
        let mut expected = ShardingConfig::default();
        change(&mut expected);
        assert_ne!(expected, ShardingConfig::default(), "{var} must change something");
        assert_eq!(load(&[(var, value)]), Ok(expected), "{var}={value}");
    }
}

#[test]
fn every_variable_is_tested_and_listed() {
    let tested: BTreeSet<&str> = ENV_CASES.iter().map(|(var, _, _)| *var).collect();
    let listed: BTreeSet<&str> = ENV_VARS.iter().copied().collect();
    // LISTEN_PORT alone is an error; it is covered by the listen address tests.
    // PREEMPTIVE_SHUTDOWN only accepts its default; it has a test of its own.
    let untested: Vec<&&str> = listed.difference(&tested).collect();
    assert_eq!(untested, [&"LISTEN_PORT", &"PREEMPTIVE_SHUTDOWN"]);
    assert!(tested.is_subset(&listed));
    assert_eq!(listed.len(), ENV_VARS.len());
}

#[test]
fn preemptive_shutdown_false_is_refused_at_load() {
    // `true` is what a runner does, so it loads; `false` would be parsed and ignored.
    assert_eq!(load(&[("PREEMPTIVE_SHUTDOWN", "true")]), Ok(ShardingConfig::default()));
    let error = load_error(&[("PREEMPTIVE_SHUTDOWN", "false")]);
    assert_eq!((error.key(), error.value()), ("PREEMPTIVE_SHUTDOWN", "false"));
    assert!(error.reason().contains("not supported"), "{error}");
    let config = ShardingConfig { preemptive_shutdown: false, ..ShardingConfig::default() };
    let error = config.validate().unwrap_err();
    assert_eq!((error.key(), error.value()), ("preemptive_shutdown", "false"));
}

#[test]
fn runner_health_check_modes_parse() {
    for mode in
        [RunnerHealthCheck::PingKnown, RunnerHealthCheck::Ping, RunnerHealthCheck::Heartbeat]
    {
        let config = load(&[("RUNNER_HEALTH_CHECK", mode.as_str())]).unwrap();
        assert_eq!(config.runner_health_check, mode);
        assert_eq!(RunnerHealthCheck::parse(&mode.to_string()), Ok(mode));
    }
    for value in ["Ping", "ping_known", "none", " ping"] {
        let error = load_error(&[("RUNNER_HEALTH_CHECK", value)]);
        assert_eq!((error.key(), error.value()), ("RUNNER_HEALTH_CHECK", value));
        assert!(error.reason().contains("ping-known"), "{error}");
    }
}

#[test]
fn runner_address_combines_host_and_port() {
    let config = load(&[("HOST", "10.0.0.7"), ("PORT", "9000")]).unwrap();
    assert_eq!(config.runner_address, Some(RunnerAddress::new("10.0.0.7", 9000)));
}

#[test]
fn listen_address_rules() {
    assert_eq!(load(&[]).unwrap().runner_listen_address, None);
    let host_only = load(&[("LISTEN_HOST", "0.0.0.0")]).unwrap();
    assert_eq!(host_only.runner_listen_address, Some(RunnerAddress::new("0.0.0.0", 34431)));
    // Without LISTEN_PORT a runner listens on the port it advertises, where peers connect.
    let container = load(&[("PORT", "5000"), ("LISTEN_HOST", "0.0.0.0")]).unwrap();
    assert_eq!(container.runner_listen_address, Some(RunnerAddress::new("0.0.0.0", 5000)));
    assert_eq!(container.runner_address, Some(RunnerAddress::new("localhost", 5000)));
    let both = load(&[("LISTEN_HOST", "::"), ("LISTEN_PORT", "8080")]).unwrap();
    assert_eq!(both.runner_listen_address, Some(RunnerAddress::new("::", 8080)));
    let ephemeral = load(&[("LISTEN_HOST", "127.0.0.1"), ("LISTEN_PORT", "0")]).unwrap();
    assert_eq!(ephemeral.runner_listen_address, Some(RunnerAddress::new("127.0.0.1", 0)));
    // The listen address never changes the advertised address.
    assert_eq!(both.runner_address, ShardingConfig::default().runner_address);

    let error = load_error(&[("LISTEN_PORT", "8080")]);
    assert_eq!((error.key(), error.value()), ("LISTEN_PORT", "8080"));
    assert!(error.reason().contains("LISTEN_HOST"), "{error}");
}

#[test]
fn booleans_accept_the_reference_literals() {
    for (value, expected) in [
        ("true", true),
        ("yes", true),
        ("on", true),
        ("1", true),
        ("y", true),
        ("false", false),
        ("no", false),
        ("off", false),
        ("0", false),
        ("n", false),
    ] {
        let config = load(&[("SHARD_LOCK_DISABLE_ADVISORY", value)]).unwrap();
        assert_eq!(config.shard_lock_disable_advisory, expected, "{value}");
    }
    for value in ["TRUE", "True", "2", "enabled", " true"] {
        let error = load_error(&[("PREEMPTIVE_SHUTDOWN", value)]);
        assert_eq!((error.key(), error.value()), ("PREEMPTIVE_SHUTDOWN", value));
    }
}

#[test]
fn lists_are_comma_separated_and_not_trimmed() {
    let config = load(&[("AVAILABLE_SHARD_GROUPS", "b,a,c"), ("SHARD_GROUPS", "c,a")]).unwrap();
    assert_eq!(config.available_shard_groups, groups(&["b", "a", "c"]));
    assert_eq!(config.assigned_shard_groups, groups(&["c", "a"]));

    let single = load(&[("AVAILABLE_SHARD_GROUPS", "only"), ("SHARD_GROUPS", "only")]).unwrap();
    assert_eq!(single.available_shard_groups, groups(&["only"]));

    for value in ["a, b", "a,,b", "a,", "a,a"] {
        let error = load_error(&[("AVAILABLE_SHARD_GROUPS", value), ("SHARD_GROUPS", "a")]);
        assert_eq!((error.key(), error.value()), ("AVAILABLE_SHARD_GROUPS", value), "{error}");
    }
}

#[test]
fn duration_strings() {
    let cases = [
        ("10 seconds", secs(10)),
        ("500 millis", millis(500)),
        ("1.5 seconds", millis(1500)),
        ("1 minute", secs(60)),
        ("2 hours", secs(2 * 60 * 60)),
        ("0 millis", Duration::ZERO),
        ("-0 seconds", Duration::ZERO),
        ("1 week", secs(7 * 24 * 60 * 60)),
        ("3 days", secs(3 * 24 * 60 * 60)),
        ("1 milli", millis(1)),
        ("250 micros", Duration::from_micros(250)),
        ("1 micro", Duration::from_micros(1)),
        ("7 nanos", Duration::from_nanos(7)),
        ("1 nano", Duration::from_nanos(1)),
        ("010 seconds", secs(10)),
        ("10\tseconds", secs(10)),
        ("10   seconds", secs(10)),
        ("10\u{a0}seconds", secs(10)),
        ("0.1 seconds", millis(100)),
        ("1.23456789123 seconds", Duration::from_nanos(1_234_567_891)),
        ("1.0000005 millis", Duration::from_nanos(1_000_001)),
        ("1.5 nanos", Duration::from_nanos(2)),
        ("0.4 nanos", Duration::ZERO),
        ("0.5 nanos", Duration::from_nanos(1)),
        ("2.4999999999999999999999999999999999999999 nanos", Duration::from_nanos(2)),
        ("0.000000000000000000000000000000000000000001 weeks", Duration::ZERO),
        ("1.5 micros", Duration::from_nanos(1500)),
        ("0.5 minutes", secs(30)),
    ];
    for (input, expected) in cases {
        assert_eq!(parse_duration(input), Ok(expected), "{input:?}");
    }
}

#[test]
fn bad_duration_strings() {
    let cases = [
        "10",
        "10s",
        "10 secs",
        "10 Seconds",
        " 10 seconds",
        "10 seconds ",
        "10 seconds\n",
        "seconds",
        "-1 seconds",
        "-0.5 millis",
        "1. seconds",
        ".5 seconds",
        "1.2.3 seconds",
        "1e3 millis",
        "+1 seconds",
        "10\u{85}seconds",
        "Infinity",
        "-Infinity",
        "infinity",
        "",
        "99999999999999999999999999999999999999999 nanos",
        "18446744073709551616 seconds",
        "١ seconds",
    ];
    for input in cases {
        let error = parse_duration(input).unwrap_err();
        assert_eq!((error.what(), error.input()), ("duration", input));
    }
    let longest = parse_duration("18446744073709551615 seconds");
    assert_eq!(longest, Ok(Duration::new(u64::MAX, 0)));
}

#[test]
fn infinity_is_only_accepted_for_the_idle_time() {
    let config = load(&[("ENTITY_MAX_IDLE_TIME", "Infinity")]).unwrap();
    assert_eq!(config.entity_max_idle_time, None);
    let error = load_error(&[("SHARD_LOCK_EXPIRATION", "Infinity")]);
    assert_eq!((error.key(), error.value()), ("SHARD_LOCK_EXPIRATION", "Infinity"));
    assert!(error.reason().contains("ENTITY_MAX_IDLE_TIME"), "{error}");
    let error = load_error(&[("ENTITY_MAX_IDLE_TIME", "-Infinity")]);
    assert_eq!(error.key(), "ENTITY_MAX_IDLE_TIME");
    let config = load(&[("MESSAGE_RETENTION", "Infinity"), ("WORKFLOW_RETENTION", "Infinity")]);
    let config = config.unwrap();
    assert_eq!((config.message_retention, config.workflow_retention), (None, None));
}

#[test]
fn a_retention_is_checked_against_its_bounds() {
    for var in ["MESSAGE_RETENTION", "WORKFLOW_RETENTION"] {
        let error = load_error(&[(var, "5 seconds")]);
        assert_eq!((error.key(), error.value()), (var, "5 seconds"), "{error}");
        assert!(error.reason().contains("10 seconds"), "{error}");
        let error = load_error(&[(var, "4000 days")]);
        assert!(error.reason().contains("Infinity"), "{error}");
        assert!(load(&[(var, "10 seconds")]).is_ok());
    }
    let config = ShardingConfig {
        message_retention: Some(Duration::from_secs(1)),
        ..ShardingConfig::default()
    };
    let error = config.validate().unwrap_err();
    assert_eq!(error.key(), "message_retention", "{error}");
}

#[test]
fn bad_values_name_the_variable_and_the_value() {
    let cases = [
        ("SHARDS_PER_GROUP", "abc"),
        ("SHARDS_PER_GROUP", "0"),
        ("SHARDS_PER_GROUP", "-3"),
        ("SHARDS_PER_GROUP", "1000000"),
        ("SHARDS_PER_GROUP", "1e3"),
        ("SHARDS_PER_GROUP", "30.0"),
        ("SHARDS_PER_GROUP", "99999999999999999999999"),
        ("SHARD_LOCK_EXPIRATION", "10"),
        ("SHARD_LOCK_EXPIRATION", "0 seconds"),
        ("SHARD_LOCK_EXPIRATION", "2 hours"),
        ("SHARD_LOCK_REFRESH_INTERVAL", "0 millis"),
        ("ENTITY_MESSAGE_POLL_INTERVAL", "0 seconds"),
        ("ENTITY_REPLY_POLL_INTERVAL", "0 seconds"),
        ("SEND_RETRY_INTERVAL", "0 seconds"),
        ("REFRESH_ASSIGNMENTS_INTERVAL", "0 seconds"),
        ("RUNNER_HEALTH_CHECK_INTERVAL", "0 seconds"),
        ("RUNNER_PROBE_INTERVAL", "0 seconds"),
        ("STORAGE_READ_TIMEOUT", "0 seconds"),
        ("STORAGE_WRITE_TIMEOUT", "2 hours"),
        ("RUNNER_JOIN_DEBOUNCE", "-5 seconds"),
        ("RUNNER_JOIN_DEBOUNCE", "2 hours"),
        ("ENTITY_MAX_IDLE_TIME", "400 days"),
        ("MAX_RESIDENT_ENTITIES", "unbounded"),
        ("MAX_RESIDENT_ENTITIES", "0"),
        ("ENTITY_MAILBOX_CAPACITY", "unbounded"),
        ("ENTITY_MAILBOX_CAPACITY", "0"),
        ("UNPROCESSED_MESSAGE_BATCH_SIZE", "-1"),
        ("UNPROCESSED_MESSAGE_BATCH_SIZE", "0"),
        ("UNPROCESSED_MESSAGE_BATCH_SIZE", "100000"),
        ("RUNNER_SHARD_WEIGHT", "0"),
        ("RUNNER_SHARD_WEIGHT", "1.5"),
        ("RUNNER_SHARD_WEIGHT", "1001"),
        ("PORT", "70000"),
        ("PORT", "0"),
        ("PORT", "http"),
        ("LISTEN_PORT", "-1"),
        ("SHARD_GROUPS", "special"),
        ("SIMULATE_REMOTE_SERIALIZATION", "maybe"),
    ];
    for (var, value) in cases {
        let error = load_error(&[(var, value)]);
        assert_eq!((error.key(), error.value()), (var, value), "{error}");
        assert!(!error.reason().is_empty());
    }
}

#[test]
fn unbounded_explains_that_it_is_programmatic_only() {
    let error = load_error(&[("MAX_RESIDENT_ENTITIES", "unbounded")]);
    assert!(error.reason().contains("programmatically"), "{error}");
}

#[test]
fn cross_field_errors_name_the_variable_at_fault() {
    // The assigned groups are the default, which the available groups no longer contain.
    let error = load_error(&[("AVAILABLE_SHARD_GROUPS", "a,b")]);
    assert_eq!((error.key(), error.value()), ("SHARD_GROUPS", "default"));
    // A group name too long for `group:shard` in 50 characters with 6-digit shard numbers.
    let long = "g".repeat(44);
    let vars = [("AVAILABLE_SHARD_GROUPS", long.as_str()), ("SHARD_GROUPS", long.as_str())];
    assert!(load(&vars).is_ok());
    let vars = [
        ("AVAILABLE_SHARD_GROUPS", long.as_str()),
        ("SHARD_GROUPS", long.as_str()),
        ("SHARDS_PER_GROUP", "100000"),
    ];
    let error = load_error(&vars);
    assert_eq!((error.key(), error.value()), ("AVAILABLE_SHARD_GROUPS", long.as_str()));
}

#[test]
fn programmatic_errors_name_the_field() {
    type Case = (&'static str, fn(&mut ShardingConfig));
    let cases: [Case; 27] = [
        ("shards_per_group", |c| c.shards_per_group = 0),
        ("shards_per_group", |c| c.shards_per_group = 1_000_000),
        ("available_shard_groups", |c| c.available_shard_groups = Vec::new()),
        ("available_shard_groups", |c| c.available_shard_groups = groups(&["default", ""])),
        ("available_shard_groups", |c| {
            c.available_shard_groups = groups(&["default", "b", "default"]);
        }),
        ("available_shard_groups", |c| {
            c.available_shard_groups =
                (0..2147).map(|i| ShardGroup::from(format!("g{i}"))).collect();
            c.assigned_shard_groups = Vec::new();
        }),
        ("assigned_shard_groups", |c| c.assigned_shard_groups = groups(&["special"])),
        ("runner_address", |c| c.runner_address = Some(RunnerAddress::new("", 1))),
        ("runner_address", |c| c.runner_address = Some(RunnerAddress::new("host", 0))),
        ("runner_address", |c| c.runner_address = Some(RunnerAddress::new("h".repeat(260), 1))),
        ("runner_listen_address", |c| c.runner_listen_address = Some(RunnerAddress::new("", 1))),
        ("runner_shard_weight", |c| c.runner_shard_weight = RunnerWeight::new(0.0).unwrap()),
        ("runner_shard_weight", |c| c.runner_shard_weight = RunnerWeight::new(-1.0).unwrap()),
        ("runner_shard_weight", |c| c.runner_shard_weight = RunnerWeight::new(1e6).unwrap()),
        ("shard_lock_expiration", |c| c.shard_lock_expiration = Duration::from_micros(999)),
        ("shard_lock_refresh_interval", |c| c.shard_lock_refresh_interval = Duration::ZERO),
        ("entity_message_poll_interval", |c| c.entity_message_poll_interval = Duration::ZERO),
        ("entity_reply_poll_interval", |c| c.entity_reply_poll_interval = Duration::ZERO),
        ("send_retry_interval", |c| c.send_retry_interval = Duration::ZERO),
        ("refresh_assignments_interval", |c| c.refresh_assignments_interval = Duration::ZERO),
        ("runner_health_check_interval", |c| c.runner_health_check_interval = Duration::ZERO),
        ("runner_probe_interval", |c| c.runner_probe_interval = Duration::ZERO),
        ("storage_read_timeout", |c| c.storage_read_timeout = Duration::ZERO),
        ("storage_write_timeout", |c| c.storage_write_timeout = Duration::from_secs(7200)),
        ("entity_max_idle_time", |c| c.entity_max_idle_time = Some(Duration::MAX)),
        ("max_resident_entities", |c| c.max_resident_entities = capacity(u32::MAX)),
        ("unprocessed_message_batch_size", |c| {
            c.unprocessed_message_batch_size = NonZeroU32::MAX;
        }),
    ];
    for (field, change) in cases {
        let mut config = ShardingConfig::default();
        change(&mut config);
        let error = config.validate().unwrap_err();
        assert_eq!(error.key(), field, "{error}");
    }
}

#[test]
fn programmatic_values_the_environment_cannot_express_are_valid() {
    let config = ShardingConfig {
        runner_address: None,
        runner_shard_weight: RunnerWeight::new(0.5).unwrap(),
        assigned_shard_groups: Vec::new(),
        entity_mailbox_capacity: Capacity::Unbounded,
        max_resident_entities: Capacity::Unbounded,
        entity_max_idle_time: None,
        entity_termination_timeout: Duration::ZERO,
        shards_per_group: SHARDS_PER_GROUP_MAX,
        available_shard_groups: (0..SHARD_GROUPS_MAX)
            .map(|i| ShardGroup::from(format!("g{i}")))
            .collect(),
        ..ShardingConfig::default()
    };
    assert_eq!(config.validate(), Ok(()));
}

#[test]
fn shard_lock_interval_is_the_refresh_interval_capped_at_a_third_of_the_expiration() {
    assert_eq!(ShardingConfig::default().shard_lock_interval(), secs(10));
    let short_expiration =
        ShardingConfig { shard_lock_expiration: secs(6), ..ShardingConfig::default() };
    assert_eq!(short_expiration.shard_lock_interval(), secs(2));
    let fast_refresh =
        ShardingConfig { shard_lock_refresh_interval: secs(1), ..ShardingConfig::default() };
    assert_eq!(fast_refresh.shard_lock_interval(), secs(1));
    let shortest = ShardingConfig {
        shard_lock_expiration: SHARD_LOCK_EXPIRATION_MIN,
        ..ShardingConfig::default()
    };
    assert!(shortest.shard_lock_interval() > Duration::ZERO);
}

#[test]
fn shard_groups_are_sorted_and_intersected() {
    let config = ShardingConfig {
        available_shard_groups: groups(&["c", "a", "b", "a"]),
        assigned_shard_groups: groups(&["b", "zzz", "c"]),
        ..ShardingConfig::default()
    };
    let shard_groups = config.shard_groups();
    let names = |set: &BTreeSet<ShardGroup>| {
        set.iter().map(|group| group.as_str().to_owned()).collect::<Vec<_>>()
    };
    assert_eq!(names(&shard_groups.available), ["a", "b", "c"]);
    assert_eq!(names(&shard_groups.assigned), ["b", "c"]);
    assert_eq!(config.group_index(&ShardGroup::from("a")), Some(0));
    assert_eq!(config.group_index(&ShardGroup::from("c")), Some(2));
    assert_eq!(config.group_index(&ShardGroup::from("zzz")), None);
}

#[test]
fn shard_id_and_batch_size() {
    let config = ShardingConfig::default();
    let group = ShardGroup::default_group();
    // Reference vector (effect 4.1.0): "entity-1" is shard 231 of 300.
    assert_eq!(config.shard_id("entity-1", &group), ShardId::new(group.clone(), 231));
    let small = ShardingConfig { shards_per_group: 1, ..ShardingConfig::default() };
    assert_eq!(small.shard_id("entity-1", &group).id(), 1);
    assert_eq!(config.batch_size(), 1024);
}

#[test]
fn advisory_lock_numbers_of_the_largest_configuration_fit_an_i32() {
    let largest = i64::from(SHARD_GROUPS_MAX) * 1_000_000 + i64::from(SHARDS_PER_GROUP_MAX);
    assert!(i32::try_from(largest).is_ok());
    let one_more_group = i64::from(SHARD_GROUPS_MAX + 1) * 1_000_000 + 999_999;
    assert!(i32::try_from(one_more_group).is_err());
}

#[test]
fn capacity_helpers() {
    assert_eq!(Capacity::bounded(0), None);
    assert_eq!(capacity(2).limit(), NonZeroU32::new(2));
    assert_eq!(Capacity::Unbounded.limit(), None);
    assert!(!capacity(2).is_full(1));
    assert!(capacity(2).is_full(2));
    assert!(!Capacity::Unbounded.is_full(usize::MAX));
    assert_eq!(capacity(4096).to_string(), "4096");
    assert_eq!(Capacity::Unbounded.to_string(), "unbounded");
}

#[test]
fn format_duration_uses_the_largest_exact_unit() {
    assert_eq!(format_duration(Duration::ZERO), "0 seconds");
    assert_eq!(format_duration(secs(35)), "35 seconds");
    assert_eq!(format_duration(secs(60)), "1 minute");
    assert_eq!(format_duration(millis(200)), "200 millis");
    assert_eq!(format_duration(millis(1500)), "1500 millis");
    assert_eq!(format_duration(Duration::from_nanos(1)), "1 nano");
    assert_eq!(format_duration(secs(14 * 24 * 60 * 60)), "2 weeks");
}

proptest! {
    #[test]
    fn parse_duration_never_panics(input in any::<String>()) {
        let _ = parse_duration(&input);
    }

    #[test]
    fn parse_duration_never_panics_near_the_grammar(
        input in "-?[0-9]{0,45}(\\.[0-9]{0,45})?[ \t]{0,2}(nanos?|micros?|millis?|seconds?|minutes?|hours?|days?|weeks?|x)",
    ) {
        let _ = parse_duration(&input);
    }

    #[test]
    fn formatted_millis_round_trip(millis in any::<u64>()) {
        prop_assert_eq!(parse_duration(&format!("{millis} millis")), Ok(Duration::from_millis(millis)));
        let fractional = format!("{}.{:03} seconds", millis / 1000, millis % 1000);
        prop_assert_eq!(parse_duration(&fractional), Ok(Duration::from_millis(millis)));
    }

    #[test]
    fn format_duration_round_trips(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
        let duration = Duration::new(secs, nanos);
        prop_assert_eq!(parse_duration(&format_duration(duration)), Ok(duration));
    }

    #[test]
    fn from_env_never_panics(var in proptest::sample::select(ENV_VARS.to_vec()), value in any::<String>()) {
        let _ = load(&[(var, value.as_str())]);
    }
}
