//! Streaming request types over HTTP: `POST /{tag}/{entityId}` answers 200 once the stream
//! started, then its items as they come, as NDJSON (`application/x-ndjson`, the default) or as
//! Server-Sent Events (`text/event-stream`, when the request's `Accept` asks for it).
//!
//! The reference's HTTP proxy has no streaming routes, so the format is this gateway's own:
//!
//! - NDJSON: one line `{"item": <item>}` per item, then one last line, the end.
//! - SSE: one event `item` per item, whose data is the item, then one event `end`.
//!
//! The end is `{"end":"complete"}`; or `{"end":"failed","error":<error>}` with the request
//! type's own error or a cluster error (the JSON a unary route answers with 500); or
//! `{"end":"defect"}` (logged, never shown); or `{"end":"interrupted"}`. A body that stops
//! without an end was cut (the gateway or the connection went away).
//!
//! A persisted stream sent again with the same primary key is not run again: it answers the
//! items not taken yet (not acknowledged by an earlier reader), then the end.
//!
//! Backpressure: a chunk is taken from the entity, and acknowledged, only when the connection
//! asks for more body, so a slow reader slows the handler down instead of filling memory.
//! Closing the connection drops the stream, which interrupts the request.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use cluster_core::envelope::{CauseReason, RawJson};
use cluster_sharding::{ErasedStream, ErasedStreamEnd};
use futures_util::StreamExt;
use tracing::Instrument;

/// How a stream's items are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    /// One JSON object per line.
    NdJson,
    /// Server-Sent Events.
    Sse,
}

impl Format {
    /// SSE when the `Accept` header names `text/event-stream` (in any case), else NDJSON.
    pub(super) fn of(headers: &axum::http::HeaderMap) -> Format {
        let sse = headers.get_all(header::ACCEPT).iter().any(|value| {
            String::from_utf8_lossy(value.as_bytes()).split(',').any(|media| {
                let media = media.split(';').next().unwrap_or_default().trim();
                media.eq_ignore_ascii_case("text/event-stream")
            })
        });
        if sse { Format::Sse } else { Format::NdJson }
    }
}

/// What one read of the stream gives.
enum Step {
    /// The items of a chunk.
    Items(Vec<RawJson>),
    /// The stream's end, as its JSON object.
    End(serde_json::Value),
}

/// Reads `stream` in `span`: the next step, and the stream again unless it ended.
async fn step(
    mut stream: ErasedStream,
    span: tracing::Span,
) -> (Step, Option<(ErasedStream, tracing::Span)>) {
    let next = stream.next_chunk().instrument(span.clone()).await;
    let _entered = span.enter();
    match next {
        Some(Ok(values)) => (Step::Items(values), Some((stream, span.clone()))),
        Some(Err(end)) => (Step::End(end_of(end)), None),
        None => {
            tracing::debug!("HTTP stream complete");
            (Step::End(serde_json::json!({ "end": "complete" })), None)
        }
    }
}

/// The answer that streams the items of `stream` in `format`.
pub(super) fn respond(stream: ErasedStream, format: Format, span: tracing::Span) -> Response {
    let steps = futures_util::stream::unfold(Some((stream, span)), |state| async move {
        let (stream, span) = state?;
        Some(step(stream, span).await)
    });
    match format {
        Format::NdJson => {
            let lines = steps.map(|step| {
                let mut text = String::new();
                match step {
                    Step::Items(items) => {
                        for item in &items {
                            text.push_str("{\"item\":");
                            text.push_str(&compact(item));
                            text.push_str("}\n");
                        }
                    }
                    Step::End(end) => {
                        text.push_str(&end.to_string());
                        text.push('\n');
                    }
                }
                Ok::<_, Infallible>(Bytes::from(text))
            });
            let mut response = (StatusCode::OK, Body::from_stream(lines)).into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
            response
        }
        Format::Sse => {
            let events = steps.flat_map(|step| {
                let events: Vec<Result<Event, Infallible>> = match step {
                    Step::Items(items) => items
                        .iter()
                        .map(|item| Ok(Event::default().event("item").data(compact(item))))
                        .collect(),
                    Step::End(end) => vec![Ok(Event::default().event("end").data(end.to_string()))],
                };
                futures_util::stream::iter(events)
            });
            Sse::new(events).keep_alive(KeepAlive::default()).into_response()
        }
    }
}

/// An item's JSON on one line: as stored, unless it holds a line break (JSON with whitespace
/// from another writer), then rewritten compact.
fn compact(value: &RawJson) -> std::borrow::Cow<'_, str> {
    let text = value.json_or_null();
    if !text.contains(['\n', '\r']) {
        return text.into();
    }
    let value = serde_json::from_str::<serde_json::Value>(text);
    value.map_or_else(|_| "null".to_owned(), |value| value.to_string()).into()
}

/// The end object of a stream that failed; a defect is logged, not shown.
fn end_of(end: ErasedStreamEnd) -> serde_json::Value {
    let failed = |error: serde_json::Value| serde_json::json!({ "end": "failed", "error": error });
    match end {
        ErasedStreamEnd::Failed(cause) => {
            let error = cause.0.iter().find_map(|reason| match reason {
                CauseReason::Fail(error) => Some(error),
                _ => None,
            });
            if let Some(error) = error {
                let text = error.json_or_null();
                return failed(serde_json::from_str(text).unwrap_or(serde_json::Value::Null));
            }
            if cause.has_interrupts_only() {
                tracing::debug!("HTTP stream interrupted");
                return serde_json::json!({ "end": "interrupted" });
            }
            tracing::error!(?cause, "HTTP stream ended with a defect");
            serde_json::json!({ "end": "defect" })
        }
        ErasedStreamEnd::Cluster(error) => match super::cluster_error_json(&error, false) {
            Some(json) => failed(json),
            None => {
                tracing::error!(%error, "HTTP stream failed in the cluster");
                serde_json::json!({ "end": "defect" })
            }
        },
        ErasedStreamEnd::Interrupted => {
            tracing::debug!("HTTP stream interrupted");
            serde_json::json!({ "end": "interrupted" })
        }
        other => {
            tracing::error!(end = ?other, "HTTP stream ended");
            serde_json::json!({ "end": "defect" })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_is_chosen_by_the_accept_header_only() {
        let mut headers = axum::http::HeaderMap::new();
        assert_eq!(Format::of(&headers), Format::NdJson);
        headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        assert_eq!(Format::of(&headers), Format::NdJson);
        headers.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream;q=0.9"),
        );
        assert_eq!(Format::of(&headers), Format::Sse);
        headers.insert(header::ACCEPT, HeaderValue::from_static("Text/Event-Stream"));
        assert_eq!(Format::of(&headers), Format::Sse);
    }

    #[test]
    fn items_with_line_breaks_are_written_on_one_line() {
        let value = RawJson::from_json("{\n  \"a\": \"x\\ny\"\n}".to_owned()).unwrap();
        assert_eq!(compact(&value), r#"{"a":"x\ny"}"#);
        let value = RawJson::from_json(r#"{"a":1}"#.to_owned()).unwrap();
        assert_eq!(compact(&value), r#"{"a":1}"#);
    }
}
