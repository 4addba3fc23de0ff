//! Every client call runs in an `entity_client` span with the entity type, id, RPC tag and
//! request id (the reference's client spans, `ClusterSchema.ClientTracingEnabled`), unless the
//! entity type turns them off; read through a minimal `tracing` subscriber installed for this
//! test binary.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cluster_core::ShardingConfig;
use cluster_sharding::{Entity, EntityContext, Handler, Protocol, RequestContext, Sharding};

use crate::entities::{Failure, Get};

/// One recorded span: its name and fields.
#[derive(Clone, Debug)]
struct Recorded {
    name: &'static str,
    fields: BTreeMap<&'static str, String>,
}

/// Records every span created in the process.
#[derive(Default)]
struct Spans {
    next: AtomicU64,
    spans: Mutex<Vec<Recorded>>,
}

struct Fields<'a>(&'a mut BTreeMap<&'static str, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }
}

impl tracing::Subscriber for Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attributes: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut fields = BTreeMap::new();
        attributes.record(&mut Fields(&mut fields));
        let name = attributes.metadata().name();
        self.spans.lock().unwrap().push(Recorded { name, fields });
        tracing::span::Id::from_u64(self.next.fetch_add(1, Ordering::SeqCst) + 1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, _: &tracing::Event<'_>) {}

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

fn spans() -> &'static Arc<Spans> {
    static SPANS: OnceLock<Arc<Spans>> = OnceLock::new();
    SPANS.get_or_init(|| {
        let spans = Arc::new(Spans::default());
        tracing::subscriber::set_global_default(Arc::clone(&spans)).expect("the only subscriber");
        spans
    })
}

/// The recorded client spans of entity type `entity_type`.
fn client_spans(entity_type: &str) -> Vec<Recorded> {
    let spans = spans().spans.lock().unwrap();
    spans
        .iter()
        .filter(|span| span.name == "entity_client")
        .filter(|span| span.fields.get("entity_type").map(String::as_str) == Some(entity_type))
        .cloned()
        .collect()
}

/// An entity with client spans (the default).
struct Traced;

impl Entity for Traced {
    const TYPE: &'static str = "Traced";

    async fn create(_context: &EntityContext) -> Traced {
        Traced
    }

    fn protocol(protocol: &mut Protocol<Traced>) {
        protocol.handle::<Get>();
    }
}

impl Handler<Get> for Traced {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<u64, Failure> {
        Ok(7)
    }
}

/// An entity that turns client spans off.
struct Untraced;

impl Entity for Untraced {
    const TYPE: &'static str = "Untraced";
    const CLIENT_TRACING: bool = false;

    async fn create(_context: &EntityContext) -> Untraced {
        Untraced
    }

    fn protocol(protocol: &mut Protocol<Untraced>) {
        protocol.handle::<Get>();
    }
}

impl Handler<Get> for Untraced {
    async fn handle(&mut self, _: &RequestContext, _: Get) -> Result<u64, Failure> {
        Ok(8)
    }
}

#[tokio::test]
async fn each_client_call_runs_in_a_span_with_the_type_tag_and_request_id() {
    spans();
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    sharding.entity::<Traced>().register().unwrap();
    sharding.entity::<Untraced>().register().unwrap();
    assert_eq!(sharding.client::<Traced>("t1").send(Get).await.unwrap(), 7);
    sharding.client::<Traced>("t2").discard(Get).await.unwrap();
    assert_eq!(sharding.client::<Untraced>("u1").send(Get).await.unwrap(), 8);

    let traced = client_spans("Traced");
    assert_eq!(traced.len(), 2, "{traced:?}");
    let ids: Vec<&str> = traced.iter().map(|span| span.fields["entity_id"].as_str()).collect();
    assert_eq!(ids, ["t1", "t2"]);
    for span in &traced {
        assert_eq!(span.fields["tag"], "Get");
        assert_eq!(span.fields["otel.name"], "Traced.client.Get");
        let request_id = &span.fields["request_id"];
        assert!(request_id.parse::<i64>().is_ok_and(|id| id > 0), "{request_id}");
    }
    assert_ne!(traced[0].fields["request_id"], traced[1].fields["request_id"]);
    assert!(client_spans("Untraced").is_empty(), "CLIENT_TRACING = false: no span");
    sharding.shutdown().await;
}
