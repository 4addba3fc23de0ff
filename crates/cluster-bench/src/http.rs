//! W9's HTTP side: a pooled HTTP/1 client to the gateway process, and the persisted echo sent
//! through it.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::Plan;
use crate::database::BenchDatabase;
use crate::drive::Measured;
use crate::workloads::{check, entity_id, measure};

/// How long the gateway process may take to answer its first request.
const UP_DEADLINE: Duration = Duration::from_secs(60);

/// A pooled HTTP/1 client to the gateway on `127.0.0.1:port`; cheap to clone.
#[derive(Clone)]
pub(crate) struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl HttpClient {
    pub(crate) fn new(port: u16) -> HttpClient {
        let client = Client::builder(TokioExecutor::new()).build_http();
        HttpClient { client, base: format!("http://127.0.0.1:{port}") }
    }

    /// `POST path` with a JSON `body`: the status and the body.
    async fn post(&self, path: &str, body: String) -> Result<(u16, Bytes), String> {
        let request = hyper::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|error| error.to_string())?;
        let response = self.client.request(request).await.map_err(|error| error.to_string())?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.map_err(|error| error.to_string())?;
        Ok((status, body.to_bytes()))
    }

    /// Waits until the gateway answers (any status: an unknown path is 404).
    pub(crate) async fn wait_until_up(&self) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + UP_DEADLINE;
        loop {
            match self.post("/", String::new()).await {
                Ok(_) => return Ok(()),
                Err(error) if tokio::time::Instant::now() >= deadline => {
                    return Err(format!("the gateway did not answer in time: {error}"));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

/// W9: W6's persisted echo (`StoredPing` with a primary key) as `POST /storedping/{entity}`.
pub(crate) async fn persisted_echo_over_http(
    plan: &Plan,
    database: Option<&BenchDatabase>,
    http: HttpClient,
) -> Result<Measured, String> {
    let plan_owned = plan.clone();
    measure(plan, database, move |n| {
        let (http, path) = (http.clone(), format!("/storedping/{}", entity_id(&plan_owned, n)));
        async move {
            let body = serde_json::json!({ "key": format!("ping-{n}"), "n": n }).to_string();
            let (status, body) = http.post(&path, body).await?;
            if status != 200 {
                return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)));
            }
            let echoed: u64 = serde_json::from_slice(&body).map_err(|error| error.to_string())?;
            check(echoed, n)
        }
    })
    .await
}
