// A process of the TypeScript reference (effect 4.1.0) on a PostgreSQL database shared with
// Rust runners, for crates/cluster-chaos/tests/interop_typescript.rs.
//
// It declares the entity type `InteropEcho` exactly as the Rust test declares it: the persisted
// request `Echo` (payload `{key, text, n}`, primary key `key`, success `{key, text, n,
// handledBy, entityId, shard}`, error `{reason}` for a negative `n`) and the volatile request
// `Ping` (payload `{n}`, success `n`). It runs in one of three modes (`INTEROP_MODE`):
//
// - `client`: a client-only process (no runner address). It prints the shard of every id in
//   `INTEROP_IDS`, sends every request of `INTEROP_REQUESTS` (a JSON array of
//   `{entityId, key, text, n}`) at once, prints one line per outcome, then `done`, and exits.
// - `runner`: a runner with the socket transport of the reference, serving `InteropEcho`. It
//   prints the shards it holds whenever they change, one line per handled request, and on
//   SIGTERM, SIGINT or the end of its standard input shuts down gracefully (handing its shards
//   over) and prints `stopped`.
// - `shards`: prints the shard of every id in `INTEROP_IDS`, then `done`, and exits.
//
// Every outcome is one JSON object on one line of standard output, with an `event` field;
// logs go to standard error. Configuration comes from the environment: `CLUSTER_STORAGE_URL`
// (postgres://…), `CLUSTER_TABLE_PREFIX` (default `cluster`), and the reference's own
// `ShardingConfig` variables in constant case (`HOST`, `PORT`, `SHARDS_PER_GROUP`,
// `SHARD_LOCK_EXPIRATION`, `ENTITY_MESSAGE_POLL_INTERVAL`, …), which are the names the Rust
// runners read too. `INTEROP_LOG_LEVEL` sets the minimum log level (default `Info`).
//
// The runner checks no runner's health (`RunnerHealth.layerNoop`): the reference's ping would
// go through its own transport, which a Rust runner does not speak (see docs/interop.md).

import { PgClient } from "@effect/sql-pg"
import { layerClientProtocol, layerSocketServer } from "@effect/platform-node-shared/NodeClusterSocket"
import { Effect, Exit, Fiber, Layer, Logger, Option, Redacted, References, Schema } from "effect"
import {
  ClusterSchema,
  Entity,
  RunnerHealth,
  ShardId,
  Sharding,
  ShardingConfig,
  SocketRunner,
  SqlMessageStorage,
  SqlRunnerStorage
} from "effect/cluster"
import { Digest } from "effect/crypto"
import { Rpc, RpcSerialization } from "effect/rpc"

// ---------------------------------------------------------------------------------------------
// The entity, as the Rust side declares it
// ---------------------------------------------------------------------------------------------

const Echoed = Schema.Struct({
  key: Schema.String,
  text: Schema.String,
  n: Schema.Number,
  handledBy: Schema.String,
  entityId: Schema.String,
  shard: Schema.String
})

const EchoRefused = Schema.Struct({ reason: Schema.String })

const Echo = Rpc.make("Echo", {
  payload: { key: Schema.String, text: Schema.String, n: Schema.Number },
  success: Echoed,
  error: EchoRefused,
  primaryKey: ({ key }) => key
}).annotate(ClusterSchema.Persisted, true)

// A volatile request: it travels over the runners' transport only, never through storage.
const Ping = Rpc.make("Ping", {
  payload: { n: Schema.Number },
  success: Schema.Number
})

const InteropEcho = Entity.make("InteropEcho", [Echo, Ping])

const EchoHandlers = InteropEcho.toLayer(Effect.gen(function*() {
  const address = yield* Entity.CurrentAddress
  const shard = ShardId.toString(address.shardId)
  return InteropEcho.of({
    Echo: ({ payload }) =>
      Effect.suspend(() => {
        emit({ event: "handled", entityId: address.entityId, key: payload.key, shard })
        if (payload.n < 0) {
          return Effect.fail({ reason: `refused ${payload.n}` })
        }
        return Effect.succeed({
          key: payload.key,
          text: payload.text,
          n: payload.n,
          handledBy: "typescript",
          entityId: address.entityId,
          shard
        })
      }),
    Ping: ({ payload }) => Effect.succeed(payload.n)
  })
}))

// ---------------------------------------------------------------------------------------------
// Configuration and output
// ---------------------------------------------------------------------------------------------

/** Writes one outcome line on standard output. */
function emit(line) {
  process.stdout.write(JSON.stringify(line) + "\n")
}

/** A required environment variable. */
function required(name) {
  const value = process.env[name]
  if (value === undefined || value === "") {
    emit({ event: "error", message: `${name} is required` })
    process.exit(2)
  }
  return value
}

const mode = required("INTEROP_MODE")
const url = required("CLUSTER_STORAGE_URL")
const prefix = process.env.CLUSTER_TABLE_PREFIX || "cluster"
const ids = (process.env.INTEROP_IDS || "").split(",").filter((id) => id !== "")
const requests = JSON.parse(process.env.INTEROP_REQUESTS || "[]")
const logLevel = process.env.INTEROP_LOG_LEVEL || "Info"

const SqlLive = PgClient.layer({ url: Redacted.make(url) })

/** The storages under the test's table prefix; the first process to start migrates. */
const StorageLive = Layer.mergeAll(
  SqlMessageStorage.layerWith({ prefix }).pipe(Layer.provide(Digest.layerWebCrypto)),
  Layer.orDie(SqlRunnerStorage.layerWith({ prefix }))
)

/** The reference's binary RPC serialization, which its socket runners speak. */
const SerializationLive = RpcSerialization.layerSchemaBinary({})

const ClientLive = SocketRunner.layerClientOnly.pipe(
  Layer.provide(layerClientProtocol),
  Layer.provideMerge(StorageLive),
  Layer.provide(SerializationLive),
  Layer.provideMerge(ShardingConfig.layerFromEnv({ runnerAddress: Option.none() })),
  Layer.provide(SqlLive)
)

const RunnerLive = SocketRunner.layer.pipe(
  Layer.provide([layerSocketServer, layerClientProtocol, RunnerHealth.layerNoop]),
  Layer.provideMerge(StorageLive),
  Layer.provide(SerializationLive),
  Layer.provideMerge(ShardingConfig.layerFromEnv()),
  Layer.provide(SqlLive)
)

// ---------------------------------------------------------------------------------------------
// The modes
// ---------------------------------------------------------------------------------------------

/** Prints the shard the reference computes for every id of `INTEROP_IDS`. */
const reportShards = Effect.gen(function*() {
  const sharding = yield* Sharding.Sharding
  for (const entityId of ids) {
    const shard = sharding.getShardId(entityId, InteropEcho.getShardGroup(entityId))
    emit({ event: "shard", entityId, shard: ShardId.toString(shard) })
  }
})

/** Sends every request of `INTEROP_REQUESTS` at once and prints each outcome. */
const sendRequests = Effect.gen(function*() {
  const clientFor = yield* InteropEcho.client
  yield* Effect.forEach(requests, (request) => {
    const { entityId, key, text, n } = request
    const started = Date.now()
    return clientFor(entityId).Echo({ key, text, n }).pipe(
      Effect.exit,
      Effect.map((exit) => {
        const millis = Date.now() - started
        if (Exit.isSuccess(exit)) {
          emit({ event: "reply", entityId, key, ok: true, value: exit.value, millis })
        } else {
          const failure = exit.cause.reasons.find((reason) => reason._tag === "Fail")
          emit(
            failure
              ? { event: "reply", entityId, key, ok: false, error: failure.error, millis }
              : { event: "reply", entityId, key, ok: false, defect: String(exit.cause), millis }
          )
        }
      })
    )
  }, { concurrency: "unbounded", discard: true })
})

/** Prints the shards this runner holds whenever they change, until interrupted. */
const watchShards = (shardsPerGroup) =>
  Effect.gen(function*() {
    const sharding = yield* Sharding.Sharding
    let last = ""
    while (true) {
      const held = []
      for (let id = 1; id <= shardsPerGroup; id++) {
        if (sharding.hasShardId(ShardId.make("default", id))) held.push(id)
      }
      const now = held.join(",")
      if (now !== last) {
        last = now
        emit({ event: "shards", group: "default", shards: held })
      }
      yield* Effect.sleep("50 millis")
    }
  })

const programs = {
  client: Effect.gen(function*() {
    yield* reportShards
    yield* sendRequests
    emit({ event: "done" })
  }).pipe(Effect.provide(ClientLive)),
  shards: Effect.gen(function*() {
    yield* reportShards
    emit({ event: "done" })
  }).pipe(Effect.provide(ClientLive)),
  runner: Effect.gen(function*() {
    const config = yield* ShardingConfig.ShardingConfig
    const address = Option.getOrNull(config.runnerAddress)
    emit({ event: "started", runner: address && `${address.host}:${address.port}` })
    yield* reportShards
    yield* watchShards(config.shardsPerGroup)
  }).pipe(Effect.provide(EchoHandlers.pipe(Layer.provideMerge(RunnerLive))))
}

const program = programs[mode]
if (program === undefined) {
  emit({ event: "error", message: `INTEROP_MODE must be client, runner or shards, not ${mode}` })
  process.exit(2)
}

const fiber = Effect.runFork(
  program.pipe(
    Effect.provideService(Logger.LogToStderr, true),
    Effect.provideService(References.MinimumLogLevel, logLevel)
  )
)

let stopping = false
function stop() {
  if (stopping) return
  stopping = true
  Effect.runFork(Fiber.interrupt(fiber))
}
process.on("SIGTERM", stop)
process.on("SIGINT", stop)
if (mode === "runner") {
  process.stdin.on("end", stop)
  process.stdin.resume()
}

fiber.addObserver((exit) => {
  if (Exit.isFailure(exit) && !(stopping && Exit.hasInterrupts(exit))) {
    emit({ event: "error", message: String(exit.cause) })
    process.exit(1)
  }
  emit({ event: "stopped" })
  process.exit(0)
})
