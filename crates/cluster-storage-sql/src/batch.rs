//! Group commit: concurrent writes that arrive while a batch is being written go together into
//! the next one.
//!
//! One commit per message caps throughput at the database's commit rate (a few thousand per
//! second on this machine's PostgreSQL and SQLite with `synchronous=FULL`); a batch of many rows
//! costs about one commit. [`Batcher`] is the queue in front of a backend's batch statement: a
//! worker task takes the first waiting write, then whatever else is already queued (up to
//! `batch_size_max`), runs them with one call, and answers each caller with its own result. There
//! is no artificial delay: under low load every batch has one write; under load, batches grow by
//! themselves.

use std::future::Future;

use cluster_core::error::{StorageError, StorageErrorKind};
use tokio::sync::{mpsc, oneshot};

type Job<Input, Output> = (Input, oneshot::Sender<Result<Output, StorageError>>);

/// A queue of writes executed in batches by one worker task.
///
/// Dropping the batcher closes its queue: the worker writes what is queued and ends.
#[derive(Debug)]
pub(crate) struct Batcher<Input, Output> {
    queue: mpsc::Sender<Job<Input, Output>>,
}

impl<Input, Output> Batcher<Input, Output>
where
    Input: Send + 'static,
    Output: Send + 'static,
{
    /// Starts a worker that runs `write` on batches of at most `batch_size_max` inputs; at most
    /// `queue_capacity` writes wait (further callers wait for room: backpressure).
    ///
    /// `write` returns one result per input, in order; a missing result is reported as an error
    /// to its caller.
    pub(crate) fn spawn<Write, Written>(
        queue_capacity: usize,
        batch_size_max: usize,
        write: Write,
    ) -> Batcher<Input, Output>
    where
        Write: Fn(Vec<Input>) -> Written + Send + 'static,
        Written: Future<Output = Vec<Result<Output, StorageError>>> + Send,
    {
        let batch_size_max = batch_size_max.max(1);
        let (queue, mut jobs) = mpsc::channel::<Job<Input, Output>>(queue_capacity.max(1));
        // The worker owns nothing but the queue's receiving end, so it cannot outlive its
        // callers by more than the batch in flight.
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(batch_size_max);
            while jobs.recv_many(&mut batch, batch_size_max).await > 0 {
                if batch.len() < batch_size_max {
                    // Woken by the first write, the worker would often take it alone: the tasks
                    // that are ready to run go first, once, so that the writes they queue join
                    // this batch (as the transport's writer does with frames).
                    tokio::task::yield_now().await;
                    while batch.len() < batch_size_max {
                        match jobs.try_recv() {
                            Ok(job) => batch.push(job),
                            Err(_) => break,
                        }
                    }
                }
                let (inputs, replies): (Vec<Input>, Vec<_>) = batch.drain(..).unzip();
                let mut results = write(inputs).await.into_iter();
                for reply in replies {
                    let result = results.next().unwrap_or_else(|| {
                        Err(StorageError::new(
                            StorageErrorKind::Other,
                            "batch returned too few results",
                        ))
                    });
                    // The caller may have gone away; its write happened anyway.
                    let _ = reply.send(result);
                }
            }
        });
        Batcher { queue }
    }

    /// How many writes wait in the queue (not counting the batch being written).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    /// Queues `input` and waits for its result.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: once queued, the write happens even if this future is dropped. The
    /// writes batched here are idempotent (keyed by id or primary key), so retrying is correct.
    pub(crate) async fn submit(&self, input: Input) -> Result<Output, StorageError> {
        let (reply, result) = oneshot::channel();
        self.queue.send((input, reply)).await.map_err(|_| stopped())?;
        result.await.map_err(|_| stopped())?
    }
}

fn stopped() -> StorageError {
    StorageError::new(StorageErrorKind::Unavailable, "the batch writer has stopped")
}

#[cfg(test)]
mod tests;
