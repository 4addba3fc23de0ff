//! `durable-cluster admin`: the [`Admin`] on the command line (feature `cli`).
//!
//! It talks to the storage directly: it needs the storage URL (`--storage` or
//! `CLUSTER_STORAGE_URL`) and the tables' prefix (`--prefix` or `CLUSTER_TABLE_PREFIX`), and
//! reads the cluster's settings (`SHARDS_PER_GROUP`, `AVAILABLE_SHARD_GROUPS`, …) from the
//! environment as a runner does. It never creates or changes a table: a URL that names the
//! wrong database fails on the first read, naming the table it misses.
//!
//! Tables by default; `--json` prints one JSON document. Exit codes: 0 success, 1 an error
//! (storage, not found, refused), 2 a usage or configuration error.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Arg, ArgAction, ArgMatches, Command};
use cluster_core::config::parse_duration;
use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use cluster_core::inspect::{LIMIT_MAX, RequestQuery};
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{ShardingConfig, Snowflake, Timestamp};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
use cluster_workflow::inspect::{ExecutionQuery, ExecutionStatus, StepOutcome};
use serde_json::Value;

use super::text::{
    BACKLOG_COLUMNS, RUNNER_COLUMNS, age, backlog_cells, exit_summary, relative, runner_cells,
    status_text, yes,
};
use super::{Action, Admin, AdminError, json};
use crate::runner::masked_url;

/// Runs `durable-cluster` with `args` (the program's name first) and returns its exit code.
#[expect(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command line tool prints its output and errors"
)]
pub async fn run(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let matches = match command().try_get_matches_from(args) {
        Ok(matches) => matches,
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    let Some(("admin", admin)) = matches.subcommand() else {
        eprintln!("error: name a command: durable-cluster admin --help");
        return ExitCode::from(2);
    };
    let deadline = match duration(admin, "timeout") {
        Ok(deadline) => deadline.unwrap_or(DEADLINE_DEFAULT),
        Err(failure) => return failed(failure),
    };
    let Ok(result) = tokio::time::timeout(deadline, run_admin(admin)).await else {
        eprintln!(
            "error: the storage did not answer within {} (--timeout): an action may or may not \
             have been applied, and repeating it is safe",
            age(deadline)
        );
        return ExitCode::from(1);
    };
    match result {
        Ok(output) => {
            print!("{output}");
            ExitCode::SUCCESS
        }
        Err(failure) => failed(failure),
    }
}

/// Reports `failure` on standard error; its exit code.
#[expect(clippy::print_stderr, reason = "a command line tool prints its errors")]
fn failed(failure: Failure) -> ExitCode {
    match failure {
        Failure::Usage(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
        Failure::Admin(error) => {
            eprintln!("error: {error}");
            ExitCode::from(1)
        }
    }
}

/// How long a command waits for the storage, without `--timeout`.
const DEADLINE_DEFAULT: Duration = Duration::from_secs(60);

/// What a command runs with.
struct Invocation<'a> {
    admin: &'a Admin,
    args: &'a ArgMatches,
    as_json: bool,
    actor: &'a str,
    now: Timestamp,
}

/// Why a command failed.
enum Failure {
    /// A wrong argument, variable or URL (exit code 2).
    Usage(String),
    /// The admin's error (exit code 1).
    Admin(AdminError),
}

impl From<AdminError> for Failure {
    fn from(error: AdminError) -> Failure {
        Failure::Admin(error)
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure::Usage(message.into())
}

/// The command line.
#[expect(clippy::too_many_lines, reason = "the declaration of every subcommand, one after another")]
pub fn command() -> Command {
    let workflow = || Arg::new("workflow").required(true).help("The workflow's name");
    let execution = || Arg::new("execution").required(true).help("The execution id");
    let request = || Arg::new("request").required(true).help("The request's id");
    let limit = || {
        Arg::new("limit").long("limit").default_value("50").help("The most rows listed (1 to 1000)")
    };
    let admin = Command::new("admin")
        .about("See and fix a cluster's runners, shards, messages and workflows")
        .arg(
            Arg::new("storage")
                .long("storage")
                .env("CLUSTER_STORAGE_URL")
                .hide_env_values(true)
                .help("postgres://…, mysql://… or sqlite:<path>"),
        )
        .arg(
            Arg::new("prefix")
                .long("prefix")
                .env("CLUSTER_TABLE_PREFIX")
                .default_value("cluster")
                .help("The tables' prefix"),
        )
        .arg(Arg::new("json").long("json").action(ArgAction::SetTrue).help("Print JSON"))
        .arg(
            Arg::new("timeout")
                .long("timeout")
                .help("The longest the command may wait for the storage (default 60 seconds)"),
        )
        .arg(
            Arg::new("actor")
                .long("actor")
                .help("Who acts, for the log of actions (default: $USER)"),
        )
        .subcommand_required(true)
        .subcommand(Command::new("runners").about("The registered runners"))
        .subcommand(Command::new("shards").about("The shard map: owner by assignment and by lock"))
        .subcommand(
            Command::new("backlog")
                .about("Unprocessed messages per entity type and shard")
                .arg(
                    Arg::new("stale-after")
                        .long("stale-after")
                        .default_value("1 minute")
                        .help("A claim older than this is stale"),
                )
                .arg(limit()),
        )
        .subcommand(
            Command::new("messages")
                .about("Requests with their final replies, newest first")
                .arg(Arg::new("type").long("type").help("Only this entity type"))
                .arg(
                    Arg::new("type-prefix").long("type-prefix").help("Only types with this prefix"),
                )
                .arg(Arg::new("entity").long("entity").help("Only this entity id"))
                .arg(Arg::new("tag").long("tag").help("Only this tag"))
                .arg(
                    Arg::new("unprocessed")
                        .long("unprocessed")
                        .action(ArgAction::SetTrue)
                        .help("Only unprocessed requests"),
                )
                .arg(Arg::new("before").long("before").help("Only ids below this (the cursor)"))
                .arg(limit()),
        )
        .subcommand(Command::new("message").about("One request").arg(request()))
        .subcommand(
            Command::new("workflows")
                .about("Workflow executions, newest first")
                .arg(Arg::new("name").long("name").help("Only this workflow"))
                .arg(
                    Arg::new("status").long("status").help(
                        "Only this status: running, suspended, completed, failed, interrupted",
                    ),
                )
                .arg(Arg::new("cursor").long("cursor").help("The next page's cursor"))
                .arg(limit()),
        )
        .subcommand(
            Command::new("workflow")
                .about("One execution and its timeline")
                .arg(workflow())
                .arg(execution()),
        )
        .subcommand(
            Command::new("stuck").about("Work that does not move").arg(
                Arg::new("threshold")
                    .long("threshold")
                    .help("The age past which due work is stuck (default: 60 poll intervals)"),
            ),
        )
        .subcommand(
            Command::new("interrupt")
                .about("Interrupt an execution")
                .arg(workflow())
                .arg(execution()),
        )
        .subcommand(
            Command::new("resume")
                .about("Resume a suspended execution")
                .arg(workflow())
                .arg(execution()),
        )
        .subcommand(
            Command::new("complete")
                .about("Complete an execution's deferred")
                .arg(workflow())
                .arg(execution())
                .arg(Arg::new("deferred").required(true).help("The deferred's name"))
                .arg(Arg::new("value").long("value").help("Succeed with this JSON value"))
                .arg(
                    Arg::new("fail")
                        .long("fail")
                        .conflicts_with("value")
                        .help("Fail with this JSON error"),
                ),
        )
        .subcommand(
            Command::new("retry").about("Retry a request whose reply is a defect").arg(request()),
        )
        .subcommand(Command::new("cancel").about("Cancel an unprocessed request").arg(request()))
        .subcommand(Command::new("release").about("Release a request's stale claim").arg(request()))
        .subcommand(
            Command::new("purge")
                .about("Delete a finished execution")
                .arg(workflow())
                .arg(execution()),
        );
    Command::new("durable-cluster")
        .about("Durable, sharded entities and workflows on a SQL database")
        .subcommand_required(true)
        .subcommand(admin)
}

async fn run_admin(matches: &ArgMatches) -> Result<String, Failure> {
    let url = matches.get_one::<String>("storage").ok_or_else(|| {
        usage("name the storage: --storage URL or CLUSTER_STORAGE_URL (postgres://…, mysql://… or sqlite:<path>)")
    })?;
    let prefix = matches.get_one::<String>("prefix").map_or("cluster", String::as_str);
    let prefix = TablePrefix::new(prefix)
        .map_err(|error| usage(format!("--prefix {prefix:?}: {}", error.reason())))?;
    let config = ShardingConfig::from_env().map_err(|error| usage(error.to_string()))?;
    let (messages, runners) = open(url, &config, prefix).await?;
    let admin = Admin::new(messages, runners, config);
    let as_json = matches.get_flag("json");
    let actor = matches
        .get_one::<String>("actor")
        .cloned()
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "cli".to_owned());
    let Some((name, args)) = matches.subcommand() else {
        return Err(usage("name a command: durable-cluster admin --help"));
    };
    let cx = Invocation { admin: &admin, args, as_json, actor: &actor, now: admin.now() };
    let output = match name {
        "runners" => runners_command(&cx).await?,
        "shards" => shards_command(&cx).await?,
        "backlog" => backlog_command(&cx).await?,
        "messages" => messages_command(&cx).await?,
        "message" => {
            let id = id_arg(args, "request")?.ok_or_else(|| usage("name the request's id"))?;
            let record = admin.request(id).await?;
            let value = json::request(&record);
            if as_json { value.to_string() } else { pretty(&value) }
        }
        "workflows" => workflows_command(&cx).await?,
        "workflow" => workflow_command(&cx).await?,
        "stuck" => stuck_command(&cx).await?,
        "interrupt" => {
            let (workflow, execution) = names(args)?;
            action(admin.interrupt(&actor, workflow, execution).await?, as_json)
        }
        "resume" => {
            let (workflow, execution) = names(args)?;
            action(admin.resume(&actor, workflow, execution).await?, as_json)
        }
        "complete" => complete_command(&cx).await?,
        "retry" => action(admin.retry(&actor, request_id(args)?).await?, as_json),
        "cancel" => action(admin.cancel(&actor, request_id(args)?).await?, as_json),
        "release" => action(admin.release_claim(&actor, request_id(args)?).await?, as_json),
        "purge" => {
            let (workflow, execution) = names(args)?;
            action(admin.purge(&actor, workflow, execution).await?, as_json)
        }

        other => return Err(usage(format!("unknown command {other}"))),
    };
    Ok(if output.ends_with('\n') { output } else { output + "\n" })
}

async fn runners_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, as_json, .. } = *cx;
    let runners = admin.runners().await?;
    Ok(if as_json {
        Value::Array(runners.iter().map(json::runner).collect()).to_string()
    } else {
        table(&upper(&RUNNER_COLUMNS), runners.iter().map(runner_cells))
    })
}

async fn shards_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, as_json, .. } = *cx;
    let shards = admin.shards().await?;
    Ok(if as_json {
        Value::Array(shards.iter().map(json::shard).collect()).to_string()
    } else {
        table(
            &["SHARD", "ASSIGNED", "LOCK HOLDER", "LEASE", "AGREES"],
            shards.iter().map(|view| {
                let lock = view.lock.as_ref();
                vec![
                    view.shard_id.to_string(),
                    view.assigned.as_ref().map_or("-".to_owned(), ToString::to_string),
                    lock.map_or("-".to_owned(), |lock| lock.holder.to_string()),
                    lock.and_then(|lock| lock.lease_age).map_or("-".to_owned(), |lease| {
                        let expired =
                            if lock.is_some_and(|lock| lock.expired) { " (expired)" } else { "" };
                        format!("{}{expired}", age(lease))
                    }),
                    yes(view.agrees()),
                ]
            }),
        )
    })
}

async fn backlog_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, args, as_json, now, .. } = *cx;
    let stale_after = duration(args, "stale-after")?.unwrap_or(Duration::from_secs(60));
    let backlogs = admin.backlog(stale_after, limit(args)?).await?;
    Ok(if as_json {
        Value::Array(backlogs.iter().map(|backlog| json::backlog(backlog, now)).collect())
            .to_string()
    } else {
        table(&upper(&BACKLOG_COLUMNS), backlogs.iter().map(|backlog| backlog_cells(backlog, now)))
    })
}

async fn messages_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, args, as_json, now, .. } = *cx;
    let query = RequestQuery {
        entity_type: args.get_one::<String>("type").cloned(),
        entity_type_prefix: args.get_one::<String>("type-prefix").cloned().unwrap_or_default(),
        entity_id: args.get_one::<String>("entity").cloned(),
        tag: args.get_one::<String>("tag").cloned(),
        processed: args.get_flag("unprocessed").then_some(false),
        before: id_arg(args, "before")?,
        newest_first: true,
        limit: limit(args)?,
        ..RequestQuery::default()
    };
    let records = admin.requests(&query).await?;
    Ok(if as_json {
        Value::Array(records.iter().map(json::request).collect()).to_string()
    } else {
        table(
            &["ID", "SENT", "ENTITY", "TAG", "STATE", "REPLY"],
            records.iter().map(|record| {
                vec![
                    record.request_id.to_string(),
                    relative(now, record.request_id.timestamp()),
                    format!("{}/{}", record.address.entity_type, record.address.entity_id),
                    record.tag.clone(),
                    request_state(record),
                    record.reply.as_ref().map_or("-", |reply| exit_summary(&reply.exit)).to_owned(),
                ]
            }),
        )
    })
}

async fn workflows_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, args, as_json, now, .. } = *cx;
    let status = args
        .get_one::<String>("status")
        .map(|status| status.parse::<ExecutionStatus>())
        .transpose()
        .map_err(|error| usage(format!("--status: {error}")))?;
    let query = ExecutionQuery {
        workflow: args.get_one::<String>("name").cloned(),
        status,
        cursor: id_arg(args, "cursor")?,
        ..ExecutionQuery::newest(limit(args)?)
    };
    let page = admin.workflows(&query).await?;
    Ok(if as_json {
        json::executions(&page).to_string()
    } else {
        let mut out = table(
            &["WORKFLOW", "EXECUTION", "STATUS", "STARTED", "UPDATED"],
            page.executions.iter().map(|summary| {
                let status = status_text(summary);
                vec![
                    summary.workflow.clone(),
                    summary.execution_id.clone(),
                    status,
                    relative(now, summary.started),
                    summary.updated.map_or("-".to_owned(), |at| relative(now, at)),
                ]
            }),
        );
        if let Some(next) = page.next {
            let _ = writeln!(out, "more: --cursor {next}");
        }
        out
    })
}

async fn workflow_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, args, as_json, now, .. } = *cx;
    let (workflow, execution) = names(args)?;
    let detail = admin.workflow(workflow, execution).await?;
    Ok(if as_json {
        json::detail(&detail).to_string()
    } else {
        let summary = &detail.summary;
        let mut out = format!(
            "{} {} — {}\nstarted {}\n",
            summary.workflow,
            summary.execution_id,
            status_text(summary),
            relative(now, summary.started),
        );
        if let Some(parent) = &summary.parent {
            let _ = writeln!(out, "parent {} {}", parent.workflow, parent.execution_id);
        }
        out.push('\n');
        out.push_str(&table(
            &["SENT", "KIND", "NAME", "OUTCOME"],
            detail.steps.iter().map(|step| {
                let outcome = match &step.outcome {
                    StepOutcome::Pending => "pending",
                    StepOutcome::Suspended => "suspended",
                    StepOutcome::Done(exit) => exit_summary(exit),
                };
                vec![
                    relative(now, step.sent),
                    step.kind.as_str().to_owned(),
                    step.name.clone(),
                    outcome.to_owned(),
                ]
            }),
        ));
        out
    })
}

async fn stuck_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, args, as_json, now, .. } = *cx;
    let threshold = duration(args, "threshold")?.unwrap_or_else(|| admin.stuck_threshold());
    let stuck = admin.stuck(threshold).await?;
    Ok(if as_json {
        json::stuck(&stuck).to_string()
    } else if stuck.is_empty() {
        format!("nothing is stuck (threshold {})\n", age(threshold))
    } else {
        let mut out = table(
            &["ENTITY TYPE", "SHARD", "DUE", "STALE", "OLDEST", "HOLDER"],
            stuck.backlogs.iter().map(|late| {
                vec![
                    late.backlog.entity_type.clone(),
                    late.backlog.shard_id.to_string(),
                    late.backlog.due.to_string(),
                    late.backlog.stale_claims.to_string(),
                    age(late.backlog.oldest_age(now)),
                    late.holder.as_ref().map_or("nobody".to_owned(), ToString::to_string),
                ]
            }),
        );
        for summary in &stuck.executions {
            let _ = writeln!(out, "missed wake: {} {}", summary.workflow, summary.execution_id);
        }
        out
    })
}

async fn complete_command(cx: &Invocation<'_>) -> Result<String, Failure> {
    let Invocation { admin, args, as_json, actor, .. } = *cx;
    let (workflow, execution) = names(args)?;
    let deferred = args.get_one::<String>("deferred").map_or("", String::as_str);
    let exit = match (args.get_one::<String>("value"), args.get_one::<String>("fail")) {
        (_, Some(error)) => {
            Exit::Failure(Cause(vec![CauseReason::Fail(json_arg("--fail", error)?)]))
        }
        (Some(value), None) => Exit::Success(json_arg("--value", value)?),
        (None, None) => Exit::void(),
    };
    let done = admin.complete_deferred(actor, workflow, execution, deferred, &exit).await?;
    Ok(action(done, as_json))
}

/// Opens the storages of `url` without running any migration.
async fn open(
    url: &str,
    config: &ShardingConfig,
    prefix: TablePrefix,
) -> Result<(Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>), Failure> {
    let options = SqlStorageOptions::from_config(config, prefix);
    let shown = masked_url(url);
    let missing = |feature: &str| {
        usage(format!("{shown}: this build lacks durable-cluster's feature `{feature}`"))
    };
    let _ = (&options, &missing);
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        {
            use cluster_storage_sql::postgres::{
                PgMessageStorage, PgRunnerStorage, parse_config, pool,
            };
            let config = parse_config(url).map_err(|error| usage(format!("{shown}: {error}")))?;
            let pool =
                pool(config.clone(), 4).map_err(|error| usage(format!("{shown}: {error}")))?;
            let messages = PgMessageStorage::without_migrations(pool.clone(), &options);
            let runners = PgRunnerStorage::without_migrations(pool, config, &options);
            return Ok((Arc::new(messages), Arc::new(runners)));
        }
        #[cfg(not(feature = "postgres"))]
        return Err(missing("postgres"));
    }
    if url.starts_with("mysql://") {
        #[cfg(feature = "mysql")]
        {
            use cluster_storage_sql::mysql::{MySqlMessageStorage, MySqlRunnerStorage, opts, pool};
            let opts = opts(url).await.map_err(|error| usage(format!("{shown}: {error}")))?;
            let pool = pool(url, 4).await.map_err(|error| usage(format!("{shown}: {error}")))?;
            let messages = MySqlMessageStorage::without_migrations(pool.clone(), &options.prefix);
            let runners = MySqlRunnerStorage::without_migrations(pool, opts, options);
            return Ok((Arc::new(messages), Arc::new(runners)));
        }
        #[cfg(not(feature = "mysql"))]
        return Err(missing("mysql"));
    }
    if let Some(path) = url.strip_prefix("sqlite:") {
        #[cfg(feature = "sqlite")]
        {
            use cluster_storage_sql::sqlite::{
                SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage,
            };
            if !std::path::Path::new(path).exists() {
                return Err(usage(format!("{shown}: no such database file")));
            }
            let messages = SqliteMessageStorage::open_without_migrations(
                path,
                SqliteOptions::new(options.clone()),
            )
            .await
            .map_err(AdminError::from)?;
            let runners =
                SqliteRunnerStorage::open_without_migrations(path, SqliteOptions::new(options))
                    .await
                    .map_err(AdminError::from)?;
            return Ok((Arc::new(messages), Arc::new(runners)));
        }
        #[cfg(not(feature = "sqlite"))]
        {
            let _ = path;
            return Err(missing("sqlite"));
        }
    }
    Err(usage(format!("{shown}: not postgres://…, mysql://… or sqlite:<path>")))
}

fn limit(args: &ArgMatches) -> Result<u32, Failure> {
    let text = args.get_one::<String>("limit").map_or("50", String::as_str);
    text.parse::<u32>()
        .ok()
        .filter(|limit| (1..=LIMIT_MAX).contains(limit))
        .ok_or_else(|| usage(format!("--limit {text}: use 1 to {LIMIT_MAX}")))
}

fn duration(args: &ArgMatches, name: &str) -> Result<Option<Duration>, Failure> {
    args.get_one::<String>(name)
        .map(|text| {
            parse_duration(text).map_err(|error| usage(format!("--{name} {text}: {error}")))
        })
        .transpose()
}

fn id_arg(args: &ArgMatches, name: &str) -> Result<Option<Snowflake>, Failure> {
    args.get_one::<String>(name)
        .map(|text| {
            text.parse::<u64>().map(Snowflake::new).map_err(|_| {
                usage(format!(
                    "{name} {text:?}: an id is a decimal number, such as 7390119431268352"
                ))
            })
        })
        .transpose()
}

fn request_id(args: &ArgMatches) -> Result<Snowflake, Failure> {
    id_arg(args, "request")?.ok_or_else(|| usage("name the request's id"))
}

fn names(args: &ArgMatches) -> Result<(&str, &str), Failure> {
    let workflow = args.get_one::<String>("workflow").ok_or_else(|| usage("name the workflow"))?;
    let execution =
        args.get_one::<String>("execution").ok_or_else(|| usage("name the execution id"))?;
    Ok((workflow, execution))
}

fn json_arg(flag: &str, text: &str) -> Result<RawJson, Failure> {
    RawJson::from_json(text.to_owned())
        .map_err(|_| usage(format!("{flag} {text:?} is not JSON (quote a string: '\"text\"')")))
}

fn action(action: Action, as_json: bool) -> String {
    if as_json { json::action(&action).to_string() } else { action.to_string() }
}

fn request_state(record: &cluster_core::inspect::RequestRecord) -> String {
    let mut state = if record.reply.is_some() || record.processed {
        "processed".to_owned()
    } else if record.claimed {
        "claimed".to_owned()
    } else {
        "waiting".to_owned()
    };
    if record.interrupted {
        state.push_str(", interrupted");
    }
    if let Some(at) = record.deliver_at {
        let _ = write!(state, ", for {}", Timestamp::unix_millis(at));
    }
    state
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

/// Column titles in capitals, as the tables print them.
fn upper(titles: &[&str]) -> Vec<String> {
    titles.iter().map(|title| title.to_uppercase()).collect()
}

/// Columns padded to their widest cell.
fn table<T: AsRef<str>>(header: &[T], rows: impl Iterator<Item = Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = rows.collect();
    let mut widths: Vec<usize> =
        header.iter().map(|title| title.as_ref().chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|title| title.as_ref().to_owned()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> =
            row.iter().zip(&widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if rows.is_empty() {
        out.push_str("(none)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_pad_their_columns() {
        let out = table(&["A", "LONGER"], [vec!["xyz".to_owned(), "1".to_owned()]].into_iter());
        assert_eq!(out, "A    LONGER\nxyz  1\n");
        assert_eq!(table(&["A"], std::iter::empty()), "A\n(none)\n");
    }

    #[test]
    fn the_command_line_is_well_formed() {
        command().debug_assert();
    }
}
