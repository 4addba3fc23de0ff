//! Commit subjects of at most [`SUBJECT_CHARS_MAX`] characters: the subject says what changed,
//! and the body says why and what was measured (docs/dev/style.md, rule 28).
//!
//! Only the commits after [`RULE_SINCE`], the commit that wrote the rule down, are checked:
//! history is not rewritten. A clone without that commit (a shallow one) or without git skips
//! the check.

use std::path::Path;
use std::process::Command;

/// The longest subject allowed, in characters.
pub(crate) const SUBJECT_CHARS_MAX: usize = 72;

/// The commit that added the rule; the commits after it are checked.
const RULE_SINCE: &str = "cad39a4";

/// The subjects that break the rule among the commits after [`RULE_SINCE`].
pub(crate) fn commit_violations(root: &Path) -> Vec<String> {
    let range = format!("{RULE_SINCE}..HEAD");
    let output =
        Command::new("git").args(["log", "--format=%h %s", &range]).current_dir(root).output();
    match output {
        Ok(output) if output.status.success() => {
            subject_violations(&String::from_utf8_lossy(&output.stdout))
        }
        // No git, or a clone without the rule's commit: nothing to check against.
        _ => Vec::new(),
    }
}

/// The violations in `log`, lines of `<hash> <subject>`.
pub(crate) fn subject_violations(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|line| {
            let (hash, subject) = line.split_once(' ').unwrap_or((line, ""));
            let chars = subject.chars().count();
            (chars > SUBJECT_CHARS_MAX).then(|| {
                format!(
                    "commit {hash}: its subject has {chars} characters, more than \
                     {SUBJECT_CHARS_MAX}; move the detail to the body (`git commit --amend` \
                     before it lands): {subject}"
                )
            })
        })
        .collect()
}
