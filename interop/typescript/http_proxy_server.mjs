// An HTTP server of the TypeScript reference (effect 4.1.0) serving the HTTP proxies of an
// entity (`EntityProxy.toHttpApiGroup` + `EntityProxyServer.layerHttpApi`) and of a workflow
// (`WorkflowProxy.toHttpApiGroup` + `WorkflowProxyServer.layerHttpApi`), for the golden fixtures
// of crates/durable-cluster/tests/fixtures/http/ (written by http_capture.mjs).
//
// Usage: `node http_proxy_server.mjs [port]` (port 0 or none: any free port). It listens on
// 127.0.0.1, prints `listening <port>` on standard output once it accepts connections, logs to
// standard error, and stops on SIGTERM, SIGINT or the end of its standard input.
//
// What it serves, with `HttpApiBuilder.layer` on `NodeHttpServer` (`@effect/platform-node`), the
// groups of the `HttpApi` `Api` without any prefix:
//
// - group `counter`: entity `Counter` on the in-memory cluster of the reference (the layers of
//   `TestRunner.layer`, with the message storage wrapped as below and an entity message poll
//   interval of 50 ms):
//   - `Increment` payload `{amount: Number}`, success `Number` (the new count), error
//     `NegativeAmount {amount}` when `amount < 0`;
//   - `Get` no payload, success `Number`;
//   - `Boom` no payload, dies (a defect; the entity is built with `disableFatalDefects: true`,
//     so that the defect reaches the caller instead of restarting the entity);
//   - `Deposit` payload `{id: String, amount: Number}`, primary key `id`, persisted
//     (`ClusterSchema.Persisted`), success `Number` (the new count); the message storage fails
//     with a `PersistenceError` when it saves a request whose primary key is `fail-persist`;
//   - `Whoami` no payload, success `String`: the entity id the entity was addressed with;
//   - `Reset` no payload, success `Schema.Void` (the default): sets the count to 0;
//   - `Reject` payload `{reason: String}`, always fails with `Rejected {reason}`, an error class
//     annotated `httpApiStatus: 409` (to show that the entity's own status annotation is kept).
// - group `sleeper`: entity `Sleeper` with `mailboxCapacity: 1`: `Sleep` payload
//   `{millis: Number}`, success `Number` (the millis), so that concurrent calls on one entity id
//   provoke `MailboxFull`; `Crash` no payload, dies, with the default (fatal) defect handling.
// - group `workflows`: workflow `Greet` on `WorkflowEngine.layerMemory`: payload
//   `{name: String}`, idempotency key `name`, success `String` (`Hello, <name>!`), error
//   `GreetRefused {name}` when `name` is empty; `name` = `boom` dies.
// - `GET /openapi.json`: the reference's OpenAPI document of the same API (`OpenApi.fromApi`,
//   through `HttpApiBuilder.layer(api, { openapiPath })`).
// - under `/forced`: a second `HttpApi` with the same generated `Counter` group whose handlers
//   fail with a cluster error chosen by the entity id (see "Forced cluster errors" below).

import { NodeHttpServer } from "@effect/platform-node"
import { Effect, Exit, Fiber, Layer, Logger, References, Ref, Schema } from "effect"
import {
  ClusterError,
  ClusterSchema,
  Entity,
  EntityProxy,
  EntityAddress,
  EntityProxyServer,
  MessageStorage,
  RunnerHealth,
  Runners,
  RunnerStorage,
  Sharding,
  ShardId,
  ShardingConfig,
  Snowflake
} from "effect/cluster"
import { HttpRouter, HttpServer } from "effect/http"
import { HttpApi, HttpApiBuilder } from "effect/http-api"
import { Rpc } from "effect/rpc"
import { Workflow, WorkflowEngine, WorkflowProxy, WorkflowProxyServer } from "effect/workflow"
import { createServer } from "node:http"
import { pathToFileURL } from "node:url"

// ---------------------------------------------------------------------------------------------
// The entities
// ---------------------------------------------------------------------------------------------

export class NegativeAmount extends Schema.TaggedError()("NegativeAmount", {
  amount: Schema.Number
}) {}

export class Rejected extends Schema.TaggedError()("Rejected", {
  reason: Schema.String
}, { httpApiStatus: 409 }) {}

export const Increment = Rpc.make("Increment", {
  payload: { amount: Schema.Number },
  success: Schema.Number,
  error: NegativeAmount
})

export const Get = Rpc.make("Get", { success: Schema.Number })

export const Boom = Rpc.make("Boom", {})

export const Deposit = Rpc.make("Deposit", {
  payload: { id: Schema.String, amount: Schema.Number },
  success: Schema.Number,
  primaryKey: ({ id }) => id
}).annotate(ClusterSchema.Persisted, true)

export const Reject = Rpc.make("Reject", {
  payload: { reason: Schema.String },
  error: Rejected
})

export const Whoami = Rpc.make("Whoami", { success: Schema.String })

export const Reset = Rpc.make("Reset", {})

export const Counter = Entity.make("Counter", [Increment, Get, Boom, Deposit, Reject, Whoami, Reset])

const CounterLive = Counter.toLayer(Effect.gen(function*() {
  const address = yield* Entity.CurrentAddress
  const count = yield* Ref.make(0)
  return Counter.of({
    Increment: ({ payload }) =>
      payload.amount < 0
        ? Effect.fail(new NegativeAmount({ amount: payload.amount }))
        : Ref.updateAndGet(count, (n) => n + payload.amount),
    Get: () => Ref.get(count),
    Boom: () => Effect.die(new Error("Boom")),
    Deposit: ({ payload }) => Ref.updateAndGet(count, (n) => n + payload.amount),
    Reject: ({ payload }) => Effect.fail(new Rejected({ reason: payload.reason })),
    Whoami: () => Effect.succeed(address.entityId),
    Reset: () => Ref.set(count, 0)
  })
}), {
  // Without it, a defect in a handler is fatal for the entity (`RpcServer` answers `Defect`, the
  // entity manager restarts the entity and replays the request): the caller never gets an answer.
  // `Sleeper.Crash` shows that default.
  disableFatalDefects: true
})

export const Sleep = Rpc.make("Sleep", {
  payload: { millis: Schema.Number },
  success: Schema.Number
})

export const Crash = Rpc.make("Crash", {})

export const Sleeper = Entity.make("Sleeper", [Sleep, Crash])

const SleeperLive = Sleeper.toLayer(
  Sleeper.of({
    Sleep: ({ payload }) => Effect.as(Effect.sleep(payload.millis), payload.millis),
    Crash: () => Effect.die(new Error("Crash"))
  }),
  { mailboxCapacity: 1 }
)

// ---------------------------------------------------------------------------------------------
// The workflow
// ---------------------------------------------------------------------------------------------

export class GreetRefused extends Schema.TaggedError()("GreetRefused", {
  name: Schema.String
}) {}

export const Greet = Workflow.make("Greet", {
  payload: { name: Schema.String },
  success: Schema.String,
  error: GreetRefused,
  idempotencyKey: ({ name }) => name
})

const GreetLive = Greet.toLayer((payload) =>
  payload.name === ""
    ? Effect.fail(new GreetRefused({ name: payload.name }))
    : payload.name === "boom"
    ? Effect.die(new Error("Greet boom"))
    : Effect.succeed(`Hello, ${payload.name}!`)
)

// ---------------------------------------------------------------------------------------------
// The API
// ---------------------------------------------------------------------------------------------

export class Api extends HttpApi.make("api")
  .add(EntityProxy.toHttpApiGroup("counter", Counter))
  .add(EntityProxy.toHttpApiGroup("sleeper", Sleeper))
  .add(WorkflowProxy.toHttpApiGroup("workflows", [Greet]))
{}

// ---------------------------------------------------------------------------------------------
// Forced cluster errors
// ---------------------------------------------------------------------------------------------

// `AlreadyProcessingMessage` and `EntityNotAssignedToRunner` cannot be provoked cheaply on one
// in-memory runner (the first comes from another runner's request, the second is retried by
// `Sharding.sendOutgoing` until the runner shuts down). To show how the reference encodes them,
// a second `HttpApi` uses the very same generated group (`EntityProxy.toHttpApiGroup`, under
// the prefix `/forced`), but its handlers fail directly with the cluster error named by the
// entity id: `mailbox-full`, `already-processing`, `not-assigned`, `persistence`. Everything
// after the handler (error schemas, status, body) is the reference's `HttpApiBuilder`.

export class ForcedApi extends HttpApi.make("forced")
  .add(EntityProxy.toHttpApiGroup("forced", Counter).prefix("/forced"))
{}

const forcedError = (entityId) => {
  const address = new EntityAddress.EntityAddress({
    shardId: ShardId.make("default", 1),
    entityType: "Counter",
    entityId
  })
  switch (entityId) {
    case "mailbox-full":
      return new ClusterError.MailboxFull({ address })
    case "already-processing":
      return new ClusterError.AlreadyProcessingMessage({ address, envelopeId: Snowflake.Snowflake("1234567890123456789") })
    case "not-assigned":
      return new ClusterError.EntityNotAssignedToRunner({ address })
    case "persistence":
      return new ClusterError.PersistenceError({ cause: new Error("storage refused the request") })
    default:
      return new Error(`unknown forced error ${entityId}`)
  }
}

const ForcedLive = HttpApiBuilder.group(ForcedApi, "forced", (handlers) => {
  for (const tag of Counter.protocol.requests.keys()) {
    handlers = handlers
      .handle(tag, ({ params }) => Effect.fail(forcedError(params.entityId)))
      .handle(`${tag}Discard`, ({ params }) => Effect.fail(forcedError(params.entityId)))
  }
  return handlers
})

// ---------------------------------------------------------------------------------------------
// The cluster: `TestRunner.layer`, with a message storage that can fail
// ---------------------------------------------------------------------------------------------

const FailingStorage = Layer.effect(
  MessageStorage.MessageStorage,
  Effect.map(MessageStorage.MemoryDriver, (driver) => ({
    ...driver.storage,
    saveRequest: (message) =>
      message.envelope.payload?.id === "fail-persist"
        ? Effect.fail(new ClusterError.PersistenceError({ cause: new Error("storage refused the request") }))
        : driver.storage.saveRequest(message)
  }))
).pipe(Layer.provideMerge(MessageStorage.MemoryDriver.layer))

const ClusterLive = Sharding.layer.pipe(
  Layer.provideMerge(Runners.layerNoop),
  Layer.provideMerge(FailingStorage),
  Layer.provide([RunnerStorage.layerMemory, RunnerHealth.layerNoop]),
  Layer.provide(ShardingConfig.layer({ entityMessagePollInterval: "50 millis" }))
)

// ---------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------

const ApiLive = HttpApiBuilder.layer(Api, { openapiPath: "/openapi.json" }).pipe(
  Layer.provide([
    EntityProxyServer.layerHttpApi(Api, "counter", Counter),
    EntityProxyServer.layerHttpApi(Api, "sleeper", Sleeper),
    WorkflowProxyServer.layerHttpApi(Api, "workflows", [Greet])
  ]),
  Layer.provide([CounterLive, SleeperLive]),
  Layer.provide(GreetLive),
  Layer.provideMerge(ClusterLive),
  Layer.provideMerge(WorkflowEngine.layerMemory)
)

const ForcedApiLive = HttpApiBuilder.layer(ForcedApi).pipe(Layer.provide(ForcedLive))

const ServerLive = (port) =>
  HttpRouter.serve(Layer.mergeAll(ApiLive, ForcedApiLive), { disableListenLog: true }).pipe(
    Layer.provideMerge(NodeHttpServer.layer(createServer, { port, host: "127.0.0.1" }))
  )

/** Serves the API on 127.0.0.1:`port` until SIGTERM, SIGINT or the end of standard input. */
const main = (port) => {
  const program = Effect.gen(function*() {
    const server = yield* HttpServer.HttpServer
    process.stdout.write(`listening ${server.address.port}\n`)
    return yield* Effect.never
  }).pipe(Effect.provide(ServerLive(port)))

  const fiber = Effect.runFork(
    program.pipe(
      Effect.provideService(Logger.LogToStderr, true),
      Effect.provideService(References.MinimumLogLevel, process.env.HTTP_PROXY_LOG_LEVEL ?? "Warn")
    )
  )

  let stopping = false
  const stop = () => {
    if (stopping) return
    stopping = true
    Effect.runFork(Fiber.interrupt(fiber))
  }
  process.on("SIGTERM", stop)
  process.on("SIGINT", stop)
  process.stdin.on("end", stop)
  process.stdin.resume()

  fiber.addObserver((exit) => {
    if (Exit.isFailure(exit) && !(stopping && Exit.hasInterrupts(exit))) {
      process.stderr.write(`error ${String(exit.cause)}\n`)
      process.exit(1)
    }
    process.exit(0)
  })
}

// The definitions above are shared with http_capture.mjs, which imports this module for
// `HttpApiClient`; only a direct run serves.
if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
  main(Number(process.argv[2] ?? 0))
}
