// Captures what the TypeScript reference's HTTP proxies answer (http_proxy_server.mjs), as golden
// fixtures for the Rust HTTP gateway of durable-cluster:
//
// - crates/durable-cluster/tests/fixtures/http/reference.json: an array of cases
//   `{ name, note?, request: { method, path, headers, body }, response: { status, headers, body,
//   json? } }`, in the order they were sent, each on a fresh entity id unless the case says
//   otherwise (the server is started once, so cases on one id see the earlier ones);
// - crates/durable-cluster/tests/fixtures/http/reference-openapi.json: the reference's OpenAPI
//   document of the same API (`OpenApi.fromApi`, served at `/openapi.json`).
//
// Usage: `node interop/typescript/http_capture.mjs` (after `npm ci --prefix interop/typescript`);
// `node interop/typescript/http_capture.mjs --client-only <port>` runs only the HttpApiClient
// cases against another server (see the end of this file).
//
// The raw cases are sent with node's fetch. `request.headers` are the headers the case sets;
// fetch adds its own (`accept: */*`, `accept-encoding`, `accept-language: *`,
// `sec-fetch-mode: cors`, `user-agent: node`, `host`, `connection: keep-alive` and
// `content-length`). Bodies are sent as bytes, so fetch adds no content-type of its own.
// The `client_*` cases are calls of effect's own `HttpApiClient` (with `FetchHttpClient`) going
// through a recording proxy: their `request` is exactly what the client put on the wire, and
// `clientResult` is what the client made of the answer.
//
// Placeholders for volatile values: the `date` response header is left out; a port in a header
// is `<port>`; a snowflake id (the `envelopeId` of a cluster error, except the fixed one of the
// forced AlreadyProcessingMessage) is `<snowflake>`; the trace headers that HttpApiClient sends
// (`b3`, `traceparent`) are `<trace>`; an error
// stack is `<stack>`. Workflow execution ids need none: they are the first 32 hex digits of
// SHA-256(`${tag.length}:${tag}:${idempotencyKey}`) (effect/src/workflow/Workflow.ts,
// makeExecutionIdFromPayload; effect/src/workflow/internal/crypto.ts, makeHashDigest).
// A case that got no answer within its time limit has `response: null` and `timedOut`.

import { spawn } from "node:child_process"
import { once } from "node:events"
import { mkdirSync, writeFileSync } from "node:fs"
import { createServer, request as httpRequest } from "node:http"
import { dirname, join } from "node:path"
import { createInterface } from "node:readline"
import { fileURLToPath } from "node:url"
import { Cause, Effect, Exit } from "effect"
import { FetchHttpClient } from "effect/http"
import { HttpApiClient } from "effect/http-api"
import { Api, Deposit } from "./http_proxy_server.mjs"

const here = dirname(fileURLToPath(import.meta.url))
const outDir = join(here, "..", "..", "crates", "durable-cluster", "tests", "fixtures", "http")

// ---------------------------------------------------------------------------------------------
// The reference server
// ---------------------------------------------------------------------------------------------

const startServer = async () => {
  const child = spawn(process.execPath, [join(here, "http_proxy_server.mjs"), "0"], {
    stdio: ["pipe", "pipe", "pipe"]
  })
  let stderr = ""
  child.stderr.on("data", (chunk) => {
    stderr += chunk
  })
  const lines = createInterface({ input: child.stdout })
  const port = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no "listening" line in 30 s; stderr:\n${stderr}`)), 30_000)
    lines.on("line", (line) => {
      const match = /^listening (\d+)$/.exec(line)
      if (match) {
        clearTimeout(timer)
        resolve(Number(match[1]))
      }
    })
    child.on("exit", (code) => reject(new Error(`server exited with ${code}; stderr:\n${stderr}`)))
  })
  const stop = async () => {
    if (child.exitCode !== null) return
    child.stdin.end()
    const timer = setTimeout(() => child.kill("SIGKILL"), 10_000)
    await once(child, "exit")
    clearTimeout(timer)
  }
  return { port, stop, stderr: () => stderr }
}

// ---------------------------------------------------------------------------------------------
// Normalization
// ---------------------------------------------------------------------------------------------

const normalizeValue = (value, key) => {
  if (Array.isArray(value)) return value.map((v) => normalizeValue(v))
  if (value !== null && typeof value === "object") {
    const out = {}
    for (const [k, v] of Object.entries(value)) out[k] = normalizeValue(v, k)
    return out
  }
  if (typeof value === "string") {
    // The forced AlreadyProcessingMessage of http_proxy_server.mjs carries a fixed id
    if ((key === "envelopeId" || key === "requestId") && value !== "1234567890123456789") return "<snowflake>"
    if (key === "stack") return "<stack>"
  }
  return value
}

const normalizeText = (text, port) => text.split(String(port)).join("<port>")

const parseJson = (text) => {
  try {
    return { ok: true, value: JSON.parse(text) }
  } catch {
    return { ok: false }
  }
}

const describeBody = (text, port, contentType) => {
  const out = {}
  const parsed = text === "" ? { ok: false } : parseJson(text)
  if (parsed.ok) {
    const json = normalizeValue(parsed.value)
    out.body = JSON.stringify(json)
    out.json = json
    if (out.body !== text) out.note = "body normalized (placeholders), see json"
  } else {
    out.body = normalizeText(text, port)
  }
  if (contentType === undefined) delete out.note
  return out
}

const responseHeaders = (headers, port) => {
  const out = {}
  for (const [name, value] of [...headers.entries()].sort(([a], [b]) => a.localeCompare(b))) {
    if (name === "date") continue
    out[name] = normalizeText(value, port)
  }
  return out
}

// ---------------------------------------------------------------------------------------------
// Raw cases
// ---------------------------------------------------------------------------------------------

const json = { "content-type": "application/json" }

/**
 * Each case: `name`, `method`, `path`, `headers`, `body` (a string), optional `note`,
 * `timeoutMs`, `bodyOmitted` (a description stored instead of a huge body).
 */
const rawCases = [
  // Entity: success, typed errors, defects
  { name: "increment_success", method: "POST", path: "/increment/e1", headers: json, body: `{"amount":2}` },
  {
    name: "increment_success_again_same_entity",
    note: "same entity id as increment_success: the entity keeps its state",
    method: "POST",
    path: "/increment/e1",
    headers: json,
    body: `{"amount":3}`
  },
  {
    name: "increment_typed_error",
    note: "NegativeAmount has no httpApiStatus annotation: default error status 500",
    method: "POST",
    path: "/increment/e2",
    headers: json,
    body: `{"amount":-1}`
  },
  {
    name: "reject_typed_error_with_status_annotation",
    note: "Rejected is declared with { httpApiStatus: 409 }: the entity's own annotation is kept",
    method: "POST",
    path: "/reject/e3",
    headers: json,
    body: `{"reason":"no"}`
  },
  {
    name: "boom_defect",
    note: "Counter is built with disableFatalDefects: true, so the handler's defect reaches the caller",
    method: "POST",
    path: "/boom/e4",
    headers: {},
    body: ""
  },
  {
    name: "boom_defect_entity_still_serves",
    method: "POST",
    path: "/get/e4",
    headers: {},
    body: ""
  },
  {
    name: "reset_void_success",
    note: "success schema Schema.Void (not a discard route)",
    method: "POST",
    path: "/reset/e1",
    headers: {},
    body: ""
  },
  // Discard
  {
    name: "increment_discard",
    method: "POST",
    path: "/increment/e5/discard",
    headers: json,
    body: `{"amount":7}`
  },
  {
    name: "get_after_discard",
    note: "same entity id as increment_discard: the discarded call was delivered",
    method: "POST",
    path: "/get/e5",
    headers: {},
    body: "",
    delayMs: 200
  },
  {
    name: "increment_discard_typed_error",
    note: "a discarded call that fails in the entity still answers 204",
    method: "POST",
    path: "/increment/e6/discard",
    headers: json,
    body: `{"amount":-1}`
  },
  {
    name: "increment_discard_invalid_payload",
    method: "POST",
    path: "/increment/e6/discard",
    headers: json,
    body: `{"amount":"x"}`
  },
  // Get: a request without payload fields (payload schema Schema.Void)
  { name: "get_no_body_no_content_type", method: "POST", path: "/get/e7", headers: {}, body: "" },
  { name: "get_no_body_json_content_type", method: "POST", path: "/get/e7", headers: json, body: "" },
  { name: "get_body_empty_object", method: "POST", path: "/get/e7", headers: json, body: "{}" },
  { name: "get_body_null", method: "POST", path: "/get/e7", headers: json, body: "null" },
  { name: "get_body_number", method: "POST", path: "/get/e7", headers: json, body: "42" },
  { name: "get_body_object_with_field", method: "POST", path: "/get/e7", headers: json, body: `{"x":1}` },
  { name: "get_body_malformed_json", method: "POST", path: "/get/e7", headers: json, body: "{" },
  { name: "get_text_plain", method: "POST", path: "/get/e7", headers: { "content-type": "text/plain" }, body: "" },
  { name: "get_discard", method: "POST", path: "/get/e7/discard", headers: {}, body: "" },
  // Payload decoding
  { name: "malformed_json", method: "POST", path: "/increment/e8", headers: json, body: `{"amount":` },
  { name: "wrong_field_type", method: "POST", path: "/increment/e8", headers: json, body: `{"amount":"x"}` },
  { name: "missing_field", method: "POST", path: "/increment/e8", headers: json, body: `{}` },
  {
    name: "extra_field",
    method: "POST",
    path: "/increment/e9",
    headers: json,
    body: `{"amount":1,"extra":true}`
  },
  { name: "json_array_body", method: "POST", path: "/increment/e8", headers: json, body: `[1]` },
  { name: "json_null_body", method: "POST", path: "/increment/e8", headers: json, body: `null` },
  { name: "empty_body_json", method: "POST", path: "/increment/e8", headers: json, body: "" },
  {
    name: "empty_body_no_content_type",
    method: "POST",
    path: "/increment/e8",
    headers: {},
    body: ""
  },
  {
    name: "amount_nan_string",
    note: "Schema.Number through its JSON codec",
    method: "POST",
    path: "/increment/e8",
    headers: json,
    body: `{"amount":"NaN"}`
  },
  {
    name: "amount_infinity_string",
    method: "POST",
    path: "/increment/e23",
    headers: json,
    body: `{"amount":"Infinity"}`
  },
  {
    name: "amount_numeric_string",
    method: "POST",
    path: "/increment/e8",
    headers: json,
    body: `{"amount":"1"}`
  },
  {
    name: "amount_float",
    method: "POST",
    path: "/increment/e10",
    headers: json,
    body: `{"amount":1.5}`
  },
  // Content types
  {
    name: "wrong_content_type_text_plain",
    method: "POST",
    path: "/increment/e8",
    headers: { "content-type": "text/plain" },
    body: `{"amount":1}`
  },
  {
    name: "wrong_content_type_form",
    method: "POST",
    path: "/increment/e8",
    headers: { "content-type": "application/x-www-form-urlencoded" },
    body: `amount=1`
  },
  {
    name: "no_content_type_json_body",
    note: "no content-type header: taken as application/json",
    method: "POST",
    path: "/increment/e11",
    headers: {},
    body: `{"amount":1}`
  },
  {
    name: "content_type_with_charset",
    method: "POST",
    path: "/increment/e12",
    headers: { "content-type": "application/json; charset=utf-8" },
    body: `{"amount":1}`
  },
  {
    name: "content_type_uppercase",
    method: "POST",
    path: "/increment/e13",
    headers: { "content-type": "Application/JSON" },
    body: `{"amount":1}`
  },
  {
    name: "content_type_vendor_json",
    method: "POST",
    path: "/increment/e8",
    headers: { "content-type": "application/vnd.api+json" },
    body: `{"amount":1}`
  },
  // Routing
  { name: "get_method_instead_of_post", method: "GET", path: "/increment/e8", headers: {}, body: "" },
  { name: "put_method", method: "PUT", path: "/increment/e8", headers: json, body: `{"amount":1}` },
  { name: "options_method", method: "OPTIONS", path: "/increment/e8", headers: {}, body: "" },
  { name: "head_method", method: "HEAD", path: "/increment/e8", headers: {}, body: "" },
  { name: "unknown_route", method: "POST", path: "/nope/e1", headers: json, body: `{}` },
  { name: "root_route", method: "GET", path: "/", headers: {}, body: "" },
  { name: "uppercase_path", method: "POST", path: "/Increment/e14", headers: json, body: `{"amount":1}` },
  { name: "missing_entity_id", method: "POST", path: "/increment/", headers: json, body: `{"amount":1}` },
  { name: "missing_entity_id_no_slash", method: "POST", path: "/increment", headers: json, body: `{"amount":1}` },
  { name: "trailing_slash", method: "POST", path: "/increment/e15/", headers: json, body: `{"amount":1}` },
  { name: "double_slash", method: "POST", path: "//increment/e16", headers: json, body: `{"amount":1}` },
  { name: "query_string_ignored", method: "POST", path: "/increment/e17?x=1", headers: json, body: `{"amount":1}` },
  { name: "whoami_plain", method: "POST", path: "/whoami/e18", headers: {}, body: "" },
  { name: "entity_id_escaped_slash", method: "POST", path: "/whoami/a%2Fb", headers: {}, body: "" },
  { name: "entity_id_escaped_space", method: "POST", path: "/whoami/a%20b", headers: {}, body: "" },
  { name: "entity_id_plus", method: "POST", path: "/whoami/a+b", headers: {}, body: "" },
  { name: "entity_id_utf8", method: "POST", path: "/whoami/caf%C3%A9", headers: {}, body: "" },
  { name: "entity_id_escaped_percent", method: "POST", path: "/whoami/100%25", headers: {}, body: "" },
  { name: "entity_id_invalid_escape", method: "POST", path: "/whoami/a%zzb", headers: {}, body: "" },
  { name: "entity_id_colon", method: "POST", path: "/whoami/a:b", headers: {}, body: "" },
  {
    name: "entity_id_semicolon",
    note: "the router cuts the path at ';' as at '?'",
    method: "POST",
    path: "/whoami/a;b",
    headers: {},
    body: ""
  },
  { name: "entity_id_uppercase", method: "POST", path: "/whoami/AbC", headers: {}, body: "" },
  {
    name: "entity_id_uppercase_path_uppercase",
    note: "routes match case-insensitively, the parameter keeps its case",
    method: "POST",
    path: "/WHOAMI/AbC",
    headers: {},
    body: ""
  },
  { name: "entity_id_escaped_letter", method: "POST", path: "/whoami/%41b", headers: {}, body: "" },
  {
    name: "entity_id_100_chars",
    method: "POST",
    path: `/whoami/${"a".repeat(100)}`,
    headers: {},
    body: ""
  },
  {
    name: "entity_id_101_chars",
    note: "the router's maxParamLength is 100",
    method: "POST",
    path: `/whoami/${"a".repeat(101)}`,
    headers: {},
    body: ""
  },
  {
    name: "entity_id_101_chars_discard",
    method: "POST",
    path: `/increment/${"a".repeat(101)}/discard`,
    headers: json,
    body: `{"amount":1}`
  },
  {
    name: "entity_id_100_chars_escaped",
    note: "100 characters once decoded (300 on the wire)",
    method: "POST",
    path: `/whoami/${"%2F".repeat(100)}`,
    headers: {},
    body: ""
  },
  {
    name: "discard_uppercase",
    method: "POST",
    path: "/increment/e22/DISCARD",
    headers: json,
    body: `{"amount":1}`
  },
  { name: "entity_id_escaped_slash_discard", method: "POST", path: "/increment/a%2Fb/discard", headers: json, body: `{"amount":1}` },
  // Large body: no limit by default (HttpIncomingMessage.MaxBodySize is undefined)
  {
    name: "large_body_11mb",
    method: "POST",
    path: "/increment/e19",
    headers: json,
    body: `{"amount":1,"pad":"${"x".repeat(11 * 1024 * 1024)}"}`,
    bodyOmitted: `{"amount":1,"pad":"<11534336 times x>"} (11534357 bytes)`,
    timeoutMs: 60_000
  },
  // Persisted request with a primary key
  {
    name: "deposit_first",
    method: "POST",
    path: "/deposit/e20",
    headers: json,
    body: `{"id":"d1","amount":5}`
  },
  {
    name: "deposit_same_primary_key",
    note: "same entity id and primary key as deposit_first, other amount: answered from storage",
    method: "POST",
    path: "/deposit/e20",
    headers: json,
    body: `{"id":"d1","amount":100}`
  },
  {
    name: "deposit_other_primary_key",
    method: "POST",
    path: "/deposit/e20",
    headers: json,
    body: `{"id":"d2","amount":1}`
  },
  {
    name: "deposit_same_primary_key_discard",
    method: "POST",
    path: "/deposit/e20/discard",
    headers: json,
    body: `{"id":"d1","amount":1000}`
  },
  { name: "get_after_deposits", method: "POST", path: "/get/e20", headers: {}, body: "", delayMs: 300 },
  {
    name: "deposit_persistence_error",
    note: "the server's message storage fails saveRequest for primary key fail-persist",
    method: "POST",
    path: "/deposit/e21",
    headers: json,
    body: `{"id":"fail-persist","amount":5}`
  },
  {
    name: "deposit_persistence_error_discard",
    method: "POST",
    path: "/deposit/e21/discard",
    headers: json,
    body: `{"id":"fail-persist","amount":5}`
  },
  // Workflow
  { name: "workflow_execute", method: "POST", path: "/greet", headers: json, body: `{"name":"alice"}` },
  {
    name: "workflow_execute_again",
    note: "same idempotency key: the stored result",
    method: "POST",
    path: "/greet",
    headers: json,
    body: `{"name":"alice"}`
  },
  { name: "workflow_execute_typed_error", method: "POST", path: "/greet", headers: json, body: `{"name":""}` },
  {
    name: "workflow_execute_defect",
    method: "POST",
    path: "/greet",
    headers: json,
    body: `{"name":"boom"}`,
    timeoutMs: 5_000
  },
  { name: "workflow_discard", method: "POST", path: "/greet/discard", headers: json, body: `{"name":"bob"}` },
  {
    name: "workflow_discard_completed",
    note: "discard of an execution that already completed (workflow_execute): the same execution id",
    method: "POST",
    path: "/greet/discard",
    headers: json,
    body: `{"name":"alice"}`
  },
  {
    name: "workflow_resume_known",
    note: "execution id of workflow_execute (alice)",
    method: "POST",
    path: "/greet/resume",
    headers: json,
    body: `{"executionId":"<alice>"}`
  },
  {
    name: "workflow_resume_unknown",
    method: "POST",
    path: "/greet/resume",
    headers: json,
    body: `{"executionId":"does-not-exist"}`
  },
  { name: "workflow_resume_missing_field", method: "POST", path: "/greet/resume", headers: json, body: `{}` },
  { name: "workflow_wrong_field_type", method: "POST", path: "/greet", headers: json, body: `{"name":1}` },
  { name: "workflow_malformed_json", method: "POST", path: "/greet", headers: json, body: `{` },
  { name: "workflow_unknown_route", method: "POST", path: "/greet/other", headers: json, body: `{"name":"x"}` },
  { name: "workflow_unknown_workflow", method: "POST", path: "/farewell", headers: json, body: `{"name":"x"}` },
  { name: "workflow_uppercase_path", method: "POST", path: "/Greet", headers: json, body: `{"name":"x"}` },
  { name: "workflow_get_method", method: "GET", path: "/greet", headers: {}, body: "" },
  // Cluster errors forced in a handler of the same generated group (see http_proxy_server.mjs)
  ...["mailbox-full", "already-processing", "not-assigned", "persistence"].flatMap((id) => [
    {
      name: `forced_${id.replaceAll("-", "_")}`,
      note: "not provoked through the cluster: the handler of the generated endpoint fails with this error",
      method: "POST",
      path: `/forced/increment/${id}`,
      headers: json,
      body: `{"amount":1}`
    },
    {
      name: `forced_${id.replaceAll("-", "_")}_discard`,
      note: "not provoked through the cluster: the handler of the generated discard endpoint fails with this error",
      method: "POST",
      path: `/forced/increment/${id}/discard`,
      headers: json,
      body: `{"amount":1}`
    }
  ]),
  // OpenAPI
  { name: "openapi_document", method: "GET", path: "/openapi.json", headers: {}, body: "", bodyToFile: true },
  // The default (fatal) defect handling of an entity: no answer; sent last, as the entity keeps
  // restarting
  {
    name: "crash_fatal_defect_default",
    note:
      "Sleeper is built without disableFatalDefects: the entity restarts and replays the request, the caller gets no answer (cut after timeoutMs)",
    method: "POST",
    path: "/crash/s9",
    headers: {},
    body: "",
    timeoutMs: 3_000
  }
]

const sendRaw = async (port, c) => {
  const controller = new AbortController()
  const timer = setTimeout(() => controller.abort(), c.timeoutMs ?? 10_000)
  try {
    const response = await fetch(`http://127.0.0.1:${port}${c.path}`, {
      method: c.method,
      headers: c.headers,
      body: c.method === "GET" || c.method === "HEAD" ? undefined : Buffer.from(c.body),
      signal: controller.signal
    })
    const text = await response.text()
    return {
      status: response.status,
      headers: responseHeaders(response.headers, port),
      ...describeBody(text, port, response.headers.get("content-type") ?? undefined)
    }
  } catch (error) {
    if (controller.signal.aborted) return null
    throw error
  } finally {
    clearTimeout(timer)
  }
}

const runRawCase = async (port, c, extra = {}) => {
  if (c.delayMs) await new Promise((resolve) => setTimeout(resolve, c.delayMs))
  const response = await sendRaw(port, c)
  const out = {
    name: c.name,
    ...(c.note ? { note: c.note } : {}),
    request: {
      method: c.method,
      path: c.path,
      headers: c.headers,
      body: c.bodyOmitted !== undefined ? `<omitted: ${c.bodyOmitted}>` : c.body
    },
    response,
    ...extra
  }
  if (response === null) {
    out.timedOut = true
    out.timeoutMs = c.timeoutMs ?? 10_000
  }
  return out
}

// ---------------------------------------------------------------------------------------------
// Concurrent cases: MailboxFull
// ---------------------------------------------------------------------------------------------

const mailboxCases = async (port) => {
  const first = {
    name: "sleep_mailbox_first",
    note: "Sleeper has mailboxCapacity 1; sent at the same time as sleep_mailbox_full, same entity id",
    method: "POST",
    path: "/sleep/s1",
    headers: json,
    body: `{"millis":500}`
  }
  const second = {
    name: "sleep_mailbox_full",
    note: "sent 100 ms after sleep_mailbox_first, same entity id, while it sleeps",
    method: "POST",
    path: "/sleep/s1",
    headers: json,
    body: `{"millis":1}`
  }
  const third = {
    name: "sleep_mailbox_full_discard",
    note: "discard while sleep_mailbox_first sleeps, same entity id",
    method: "POST",
    path: "/sleep/s1/discard",
    headers: json,
    body: `{"millis":1}`
  }
  const a = runRawCase(port, first)
  await new Promise((resolve) => setTimeout(resolve, 100))
  const b = await runRawCase(port, second)
  const c = await runRawCase(port, third)
  return [await a, b, c]
}

// ---------------------------------------------------------------------------------------------
// HttpApiClient cases, through a recording proxy
// ---------------------------------------------------------------------------------------------

const startRecordingProxy = async (targetPort) => {
  const recorded = []
  const server = createServer((req, res) => {
    const chunks = []
    req.on("data", (chunk) => chunks.push(chunk))
    req.on("end", () => {
      const body = Buffer.concat(chunks)
      const entry = {
        method: req.method,
        path: req.url,
        headers: Object.fromEntries(
          Object.entries(req.headers).sort(([a], [b]) => a.localeCompare(b))
        ),
        body: body.toString("utf8")
      }
      recorded.push(entry)
      const upstream = httpRequest({
        host: "127.0.0.1",
        port: targetPort,
        method: req.method,
        path: req.url,
        headers: req.headers
      }, (upstreamResponse) => {
        const responseChunks = []
        upstreamResponse.on("data", (chunk) => responseChunks.push(chunk))
        upstreamResponse.on("end", () => {
          const responseBody = Buffer.concat(responseChunks)
          entry.response = {
            status: upstreamResponse.statusCode,
            headers: new Headers(
              Object.entries(upstreamResponse.headers).map(([k, v]) => [k, Array.isArray(v) ? v.join(", ") : v])
            ),
            body: responseBody.toString("utf8")
          }
          res.writeHead(upstreamResponse.statusCode, upstreamResponse.headers)
          res.end(responseBody)
        })
      })
      upstream.on("error", (error) => {
        res.writeHead(502)
        res.end(String(error))
      })
      upstream.end(body)
    })
  })
  server.listen(0, "127.0.0.1")
  await once(server, "listening")
  return { port: server.address().port, recorded, close: () => server.close() }
}

const clientCalls = [
  {
    name: "client_increment",
    call: `counter.Increment({ params: { entityId: "c1" }, payload: { amount: 2 } })`,
    run: (client) => client.counter.Increment({ params: { entityId: "c1" }, payload: { amount: 2 } })
  },
  {
    name: "client_increment_typed_error",
    call: `counter.Increment({ params: { entityId: "c1" }, payload: { amount: -1 } })`,
    run: (client) => client.counter.Increment({ params: { entityId: "c1" }, payload: { amount: -1 } })
  },
  {
    name: "client_reset_void_success",
    call: `counter.Reset({ params: { entityId: "c1" }, payload: undefined })`,
    run: (client) => client.counter.Reset({ params: { entityId: "c1" }, payload: undefined })
  },
  {
    name: "client_increment_discard",
    call: `counter.IncrementDiscard({ params: { entityId: "c1" }, payload: { amount: 1 } })`,
    run: (client) => client.counter.IncrementDiscard({ params: { entityId: "c1" }, payload: { amount: 1 } })
  },
  {
    name: "client_get",
    call: `counter.Get({ params: { entityId: "c1" }, payload: undefined })`,
    run: (client) => client.counter.Get({ params: { entityId: "c1" }, payload: undefined })
  },
  {
    name: "client_get_discard",
    call: `counter.GetDiscard({ params: { entityId: "c1" }, payload: undefined })`,
    run: (client) => client.counter.GetDiscard({ params: { entityId: "c1" }, payload: undefined })
  },
  {
    name: "client_whoami_escaped",
    call: `counter.Whoami({ params: { entityId: "a/b c%" }, payload: undefined })`,
    run: (client) => client.counter.Whoami({ params: { entityId: "a/b c%" }, payload: undefined })
  },
  {
    name: "client_boom_defect",
    call: `counter.Boom({ params: { entityId: "c2" }, payload: undefined })`,
    run: (client) => client.counter.Boom({ params: { entityId: "c2" }, payload: undefined })
  },
  {
    name: "client_reject_409",
    call: `counter.Reject({ params: { entityId: "c2" }, payload: { reason: "no" } })`,
    run: (client) => client.counter.Reject({ params: { entityId: "c2" }, payload: { reason: "no" } })
  },
  {
    name: "client_deposit",
    call: `counter.Deposit({ params: { entityId: "c3" }, payload: Deposit.payloadSchema.make({ id: "k1", amount: 4 }) })`,
    run: (client) =>
      client.counter.Deposit({
        params: { entityId: "c3" },
        payload: Deposit.payloadSchema.make({ id: "k1", amount: 4 })
      })
  },
  {
    name: "client_deposit_persistence_error",
    call:
      `counter.Deposit({ params: { entityId: "c3" }, payload: Deposit.payloadSchema.make({ id: "fail-persist", amount: 4 }) })`,
    run: (client) =>
      client.counter.Deposit({
        params: { entityId: "c3" },
        payload: Deposit.payloadSchema.make({ id: "fail-persist", amount: 4 })
      })
  },
  {
    name: "client_workflow_execute",
    call: `workflows.Greet({ payload: { name: "carol" } })`,
    run: (client) => client.workflows.Greet({ payload: { name: "carol" } })
  },
  {
    name: "client_workflow_typed_error",
    call: `workflows.Greet({ payload: { name: "" } })`,
    run: (client) => client.workflows.Greet({ payload: { name: "" } })
  },
  {
    name: "client_workflow_discard",
    call: `workflows.GreetDiscard({ payload: { name: "dave" } })`,
    run: (client) => client.workflows.GreetDiscard({ payload: { name: "dave" } })
  },
  {
    name: "client_workflow_resume",
    call: `workflows.GreetResume({ payload: { executionId: "does-not-exist" } })`,
    run: (client) => client.workflows.GreetResume({ payload: { executionId: "does-not-exist" } })
  }
]

const describeExit = (exit) => {
  if (Exit.isSuccess(exit)) return { _tag: "Success", value: exit.value === undefined ? null : exit.value }
  const failure = exit.cause.reasons.find(Cause.isFailReason)
  if (failure) {
    const error = failure.error
    const fields = {}
    for (const k of new Set([...Object.keys(error), ..."cause" in error ? ["cause"] : []])) {
      const v = error[k]
      if (k === "~effect/cluster/ClusterError" || typeof v === "function") continue
      fields[k] = v instanceof Error ? { name: v.name, message: v.message } : v
    }
    return {
      _tag: "Failure",
      errorTag: error?._tag,
      errorName: error?.constructor?.name,
      error: normalizeValue(JSON.parse(JSON.stringify(fields, (_k, v) => (typeof v === "bigint" ? String(v) : v))))
    }
  }
  return { _tag: "Die", cause: String(Cause.squash(exit.cause)) }
}

const runClientCases = async (serverPort) => {
  const proxy = await startRecordingProxy(serverPort)
  const out = []
  try {
    for (const c of clientCalls) {
      const before = proxy.recorded.length
      const exit = await Effect.runPromiseExit(
        Effect.gen(function*() {
          const client = yield* HttpApiClient.make(Api, { baseUrl: `http://127.0.0.1:${proxy.port}` })
          return yield* c.run(client)
        }).pipe(Effect.provide(FetchHttpClient.layer), Effect.timeout("10 seconds"))
      )
      const request = proxy.recorded[before]
      const headers = {}
      for (const [k, v] of Object.entries(request?.headers ?? {})) {
        headers[k] = k === "b3" || k === "traceparent" ? "<trace>" : normalizeText(String(v), proxy.port)
      }
      const response = request?.response
      out.push({
        name: c.name,
        call: c.call,
        request: request && { method: request.method, path: request.path, headers, body: request.body },
        response: response && {
          status: response.status,
          headers: responseHeaders(response.headers, serverPort),
          ...describeBody(response.body, serverPort, response.headers.get("content-type") ?? undefined)
        },
        clientResult: JSON.parse(normalizeText(JSON.stringify(describeExit(exit)), proxy.port))
      })
    }
  } finally {
    proxy.close()
  }
  return out
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

const main = async () => {
  const server = await startServer()
  const cases = []
  let openapi
  try {
    for (const c of rawCases) {
      if (c.name === "crash_fatal_defect_default") {
        cases.push(...await mailboxCases(server.port))
        cases.push(...await runClientCases(server.port))
      }
      let current = c
      if (c.body === `{"executionId":"<alice>"}`) {
        const alice = cases.find((x) => x.name === "workflow_discard_completed")
        current = { ...c, body: JSON.stringify({ executionId: alice.response.json }) }
      }
      const result = await runRawCase(server.port, current)
      if (c.bodyToFile) {
        openapi = result.response.json
        result.response.body = "<see reference-openapi.json>"
        delete result.response.json
        delete result.response.note
      }
      cases.push(result)
    }
  } finally {
    await server.stop()
  }
  mkdirSync(outDir, { recursive: true })
  writeFileSync(join(outDir, "reference.json"), JSON.stringify(cases, null, 2) + "\n")
  writeFileSync(join(outDir, "reference-openapi.json"), JSON.stringify(openapi, null, 2) + "\n")
  process.stdout.write(`wrote ${cases.length} cases to ${join(outDir, "reference.json")}\n`)
}

// `--client-only <port>`: only the HttpApiClient cases, against a server of another
// implementation on 127.0.0.1:<port> (the Rust gateway of crates/durable-cluster/tests/http.rs),
// printed as one JSON array of `{ name, status, clientResult }` on standard output.
if (process.argv[2] === "--client-only") {
  const cases = await runClientCases(Number(process.argv[3]))
  const results = cases.map((c) => ({ name: c.name, status: c.response?.status ?? null, clientResult: c.clientResult }))
  process.stdout.write(JSON.stringify(results) + "\n")
} else {
  await main()
}
