//! What a test reads of the runtime's logs: [`Warnings`], a subscriber that keeps the
//! warnings logged while it is the default one.

use std::sync::{Arc, Mutex};

use cluster_core::sync::lock;

/// The warnings logged while it is the thread's default subscriber
/// (`tracing::subscriber::with_default`, or `set_default`), each as its fields
/// (`name=value `, the message first).
#[derive(Clone, Default)]
pub struct Warnings(Arc<Mutex<Vec<String>>>);

impl std::fmt::Debug for Warnings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Warnings").field(&self.logged().len()).finish()
    }
}

impl Warnings {
    /// The warnings logged so far.
    pub fn logged(&self) -> Vec<String> {
        lock(&self.0).clone()
    }
}

/// An event's fields as one line.
struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

impl tracing::Subscriber for Warnings {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::WARN {
            let mut line = String::new();
            event.record(&mut Fields(&mut line));
            lock(&self.0).push(line);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

#[cfg(test)]
mod tests {
    use super::Warnings;

    #[test]
    fn only_warnings_are_kept_with_their_fields() {
        let warnings = Warnings::default();
        tracing::subscriber::with_default(warnings.clone(), || {
            tracing::info!(shard = 3, "not kept");
            tracing::warn!(shard = 7, "kept");
            tracing::error!("not a warning");
        });
        assert_eq!(warnings.logged(), ["message=kept shard=7 "]);
    }
}
