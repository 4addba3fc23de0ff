//! The process's `metrics` recorder: Prometheus, except for the per-entity mailbox series
//! (`effect_cluster_entity_mailbox_size`), which it keeps itself.
//!
//! The `metrics` facade cannot remove a series, and the Prometheus exporter keeps every series
//! it was ever given. With `entity_mailbox_metrics` on, each entity id that ever ran would stay
//! in `/metrics` for the life of the process: a flood of new ids would grow it without bound.
//! An entity holds its mailbox gauge while it is resident and drops it when it stops; this
//! recorder keeps only a weak reference to it, so the series leaves `/metrics` with the entity.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use cluster_core::sync::lock;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::PrometheusRecorder;

/// The per-entity series this recorder keeps.
const KEPT: &str = cluster_sharding::metrics::ENTITY_MAILBOX_SIZE;

/// The live per-entity series, by key; the entities hold the strong references.
#[derive(Default)]
pub(crate) struct EntitySeries {
    series: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_key: BTreeMap<Key, Weak<AtomicU64>>,
    /// The size at which the next registration prunes the series of stopped entities.
    prune_at: usize,
}

impl EntitySeries {
    fn gauge(&self, key: &Key) -> Gauge {
        let mut kept = lock(&self.series);
        if let Some(value) = kept.by_key.get(key).and_then(Weak::upgrade) {
            return Gauge::from_arc(value);
        }
        if kept.by_key.len() >= kept.prune_at {
            kept.by_key.retain(|_, value| value.strong_count() > 0);
            kept.prune_at = kept.by_key.len().saturating_mul(2).max(1024);
        }
        let value = Arc::new(AtomicU64::new(0));
        kept.by_key.insert(key.clone(), Arc::downgrade(&value));
        Gauge::from_arc(value)
    }

    /// Appends the live series to `out` in the Prometheus text format.
    pub(crate) fn render(&self, out: &mut String) {
        let mut kept = lock(&self.series);
        kept.by_key.retain(|_, value| value.strong_count() > 0);
        if kept.by_key.is_empty() {
            return;
        }
        let _ = writeln!(out, "# TYPE {KEPT} gauge");
        for (key, value) in &kept.by_key {
            let Some(value) = value.upgrade() else { continue };
            out.push_str(key.name());
            let mut separator = '{';
            for label in key.labels() {
                out.push(separator);
                separator = ',';
                out.push_str(label.key());
                out.push_str("=\"");
                escape_label_value(label.value(), out);
                out.push('"');
            }
            if separator == ',' {
                out.push('}');
            }
            let _ = writeln!(out, " {}", f64::from_bits(value.load(Ordering::Acquire)));
        }
        out.push('\n');
    }
}

/// Escapes a label value as the Prometheus text format asks: backslash, double quote and
/// line feed. Entity ids come from callers, so they may hold any of them.
fn escape_label_value(value: &str, out: &mut String) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Prometheus for every series but the kept ones.
pub(crate) struct SplitRecorder {
    pub(crate) prometheus: PrometheusRecorder,
    pub(crate) entities: Arc<EntitySeries>,
}

impl Recorder for SplitRecorder {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.prometheus.register_counter(key, metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if key.name() == KEPT {
            self.entities.gauge(key)
        } else {
            self.prometheus.register_gauge(key, metadata)
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.prometheus.register_histogram(key, metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Key {
        let labels = vec![
            metrics::Label::new("type", "Counter"),
            metrics::Label::new("id", id.to_owned()),
            metrics::Label::new("shard", "default:1"),
        ];
        Key::from_parts(KEPT, labels)
    }

    #[test]
    fn a_series_leaves_with_the_last_handle_and_labels_are_escaped() {
        let series = EntitySeries::default();
        let kept = series.gauge(&key("a\"b\\c\nd"));
        kept.set(3.0);
        let gone = series.gauge(&key("gone"));
        gone.set(1.0);
        drop(gone);
        let mut out = String::new();
        series.render(&mut out);
        assert_eq!(
            out,
            "# TYPE effect_cluster_entity_mailbox_size gauge\n\
             effect_cluster_entity_mailbox_size{type=\"Counter\",id=\"a\\\"b\\\\c\\nd\",\
             shard=\"default:1\"} 3\n\n"
        );
        drop(kept);
        let mut out = String::new();
        series.render(&mut out);
        assert_eq!(out, "");
    }

    #[test]
    fn registering_again_shares_the_live_series_and_prunes_stopped_ones() {
        let series = EntitySeries::default();
        let first = series.gauge(&key("same"));
        let second = series.gauge(&key("same"));
        second.set(2.0);
        let mut out = String::new();
        series.render(&mut out);
        assert!(out.contains("id=\"same\",shard=\"default:1\"} 2\n"), "{out}");
        drop((first, second));
        for n in 0..5_000 {
            drop(series.gauge(&key(&format!("flood-{n}"))));
        }
        let held = series.series.lock().unwrap().by_key.len();
        assert!(held <= 1024, "{held} series held after a flood of stopped entities");
    }
}
