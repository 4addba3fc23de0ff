//! A runner process (`chaos runner`, on `durable_cluster::Runner::main_with`) that cannot start
//! says why in one line on standard error and exits with a code that tells a wrong setting (2)
//! from another failure (1); it never panics.

use std::process::{Command, Output};

/// Runs `chaos runner` with `vars` on a fresh SQLite file, bounded by 60 seconds.
fn runner(name: &str, vars: &[(&str, &str)]) -> Output {
    let database =
        std::env::temp_dir().join(format!("chaos-runner-{name}-{}.db", std::process::id()));
    let mut command = Command::new(env!("CARGO_BIN_EXE_chaos"));
    command
        .arg("runner")
        .env_clear()
        .env("CLUSTER_STORAGE_URL", format!("sqlite:{}", database.display()))
        .env("HOST", "127.0.0.1")
        .env("PORT", free_port().to_string());
    for (name, value) in vars {
        command.env(name, value);
    }
    let output = command.output().expect("the chaos binary runs");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", database.display()));
    }
    output
}

/// A port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Standard error as one trimmed string, and its number of lines.
fn stderr(output: &Output) -> (String, usize) {
    let text = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    let lines = text.lines().count();
    (text, lines)
}

#[test]
fn a_wrong_variable_exits_with_code_2_and_one_line_naming_it() {
    for (name, value) in [
        ("SHARDS_PER_GROUP", "many"),
        ("CLUSTER_RPC_MAX_IN_FLIGHT", "-1"),
        ("CLUSTER_OPS_LISTEN", "nine-thousand"),
        ("CLUSTER_STORAGE_URL", "redis://localhost"),
    ] {
        let output = runner("wrong", &[(name, value)]);
        let (text, lines) = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{name}={value}: {text}");
        assert_eq!(lines, 1, "{name}={value}: {text}");
        assert!(text.contains(name) && text.contains(value), "{name}={value}: {text}");
        assert!(!text.contains("panicked"), "{text}");
    }
}

#[test]
fn an_operations_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let output = runner("busy", &[("CLUSTER_OPS_LISTEN", &address)]);
    let (text, lines) = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert_eq!(lines, 1, "{text}");
    assert!(text.contains("CLUSTER_OPS_LISTEN") && text.contains(&address), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}
