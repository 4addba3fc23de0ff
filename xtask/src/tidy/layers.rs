//! Imports a crate's layers must not make, over the same `use crate::…` edges as `circles`.
//!
//! `cluster-sharding` is a thin handle (`sharding`) over components in layer folders:
//!
//! - **No component names the handle.** Modules under `runtime`, `placement` and `services`,
//!   and the entity and request types of `api`, do not import `sharding`, `builder` or the
//!   typed client.
//!   The contexts hold the handle erased; a component that calls back defines the trait it
//!   needs.
//! - **The persisted path reads one way.** A request goes client, persisted delivery, manager,
//!   and its outcome comes back on the channels of its delivery.
//!   So the managers, their registry and the delivery seam never import persisted delivery.

use std::path::Path;

use anyhow::Result;

use super::circles::{edges, load_modules};

/// One forbidden import: in `krate`, no module under `from` imports a module under `to`.
pub(crate) struct Forbidden {
    /// The crate's folder name under `crates/`.
    pub(crate) krate: &'static str,
    /// A module path prefix (whole segments) of the importing modules.
    pub(crate) from: &'static str,
    /// A module path prefix of the imported modules.
    pub(crate) to: &'static str,
    /// Why, for the violation's message.
    pub(crate) why: &'static str,
}

/// The handle and what sits on top of it.
const HANDLE: [&str; 3] = ["sharding", "builder", "api::client"];
/// The modules below the handle.
const COMPONENTS: [&str; 6] =
    ["runtime", "placement", "services", "api::entity", "api::rpc", "api::queue_entity"];
/// The modules a persisted request passes on its way to the entity, before persisted delivery.
const BEFORE_PERSISTED: [&str; 4] =
    ["runtime::manager", "runtime::registry", "runtime::delivery", "runtime::local"];

/// Every forbidden import.
pub(crate) fn rules() -> Vec<Forbidden> {
    let mut rules = Vec::new();
    for from in COMPONENTS {
        for to in HANDLE {
            rules.push(Forbidden {
                krate: "cluster-sharding",
                from,
                to,
                why: "a component does not name the handle",
            });
        }
    }
    for from in BEFORE_PERSISTED {
        rules.push(Forbidden {
            krate: "cluster-sharding",
            from,
            to: "runtime::persisted",
            why: "the persisted path reads one way",
        });
    }
    rules
}

/// Whether `module` is `prefix` or inside it.
fn under(module: &str, prefix: &str) -> bool {
    module == prefix || module.strip_prefix(prefix).is_some_and(|rest| rest.starts_with("::"))
}

/// The violations of `rules` among the edges of one crate's modules.
pub(crate) fn violations_in(
    krate: &str,
    edges: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
    rules: &[Forbidden],
) -> Vec<String> {
    let mut found = Vec::new();
    for rule in rules.iter().filter(|rule| rule.krate == krate) {
        for (module, targets) in edges {
            if !under(module, rule.from) {
                continue;
            }
            for target in targets.iter().filter(|target| under(target, rule.to)) {
                found.push(format!("{krate}: `{module}` imports `{target}` ({})", rule.why));
            }
        }
    }
    found
}

/// The violations of every crate that has rules.
pub(crate) fn layer_violations(root: &Path) -> Result<Vec<String>> {
    let rules = rules();
    let mut crates: Vec<&str> = rules.iter().map(|rule| rule.krate).collect();
    crates.dedup();
    let mut found = Vec::new();
    for krate in crates {
        let src = root.join("crates").join(krate).join("src");
        found.extend(violations_in(krate, &edges(&load_modules(&src)?), &rules));
    }
    Ok(found)
}
