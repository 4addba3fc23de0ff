//! Tests of the batcher: results go to their callers, batches form under load, failures stay
//! with their input.

use std::sync::Arc;

use tokio::sync::Notify;

use super::*;

#[tokio::test]
async fn each_caller_gets_its_own_result() {
    let batcher = Batcher::spawn(16, 8, |inputs: Vec<u32>| async move {
        inputs
            .into_iter()
            .map(|input| {
                if input % 2 == 0 {
                    Ok(input * 10)
                } else {
                    Err(StorageError::new(StorageErrorKind::Conflict, format!("odd {input}")))
                }
            })
            .collect()
    });
    assert_eq!(batcher.submit(2).await.unwrap(), 20);
    assert_eq!(batcher.submit(3).await.unwrap_err().kind(), StorageErrorKind::Conflict);
}

#[tokio::test]
async fn writes_queued_during_a_batch_form_the_next_batch() {
    let gate = Arc::new(Notify::new());
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let batcher = Arc::new(Batcher::spawn(64, 32, {
        let gate = Arc::clone(&gate);
        let sizes = Arc::clone(&sizes);
        move |inputs: Vec<u32>| {
            let gate = Arc::clone(&gate);
            let sizes = Arc::clone(&sizes);
            async move {
                sizes.lock().unwrap().push(inputs.len());
                // The first batch waits until every other write is queued.
                if inputs == [0] {
                    gate.notified().await;
                }
                inputs.into_iter().map(Ok).collect()
            }
        }
    }));
    let first = tokio::spawn({
        let batcher = Arc::clone(&batcher);
        async move { batcher.submit(0).await }
    });
    // Wait until the first batch is being written.
    while sizes.lock().unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    let mut others = Vec::new();
    for input in 1..=10 {
        let batcher = Arc::clone(&batcher);
        others.push(tokio::spawn(async move { batcher.submit(input).await }));
    }
    while batcher.queued() < 10 {
        tokio::task::yield_now().await;
    }
    gate.notify_one();
    assert_eq!(first.await.unwrap().unwrap(), 0);
    for (idx, other) in others.into_iter().enumerate() {
        assert_eq!(other.await.unwrap().unwrap(), u32::try_from(idx).unwrap() + 1);
    }
    let sizes = sizes.lock().unwrap().clone();
    assert_eq!(sizes[0], 1);
    assert_eq!(sizes.iter().sum::<usize>(), 11);
    assert!(sizes.len() < 11, "writes queued during a batch were batched: {sizes:?}");
}

#[tokio::test]
async fn a_short_result_list_fails_the_rest() {
    let batcher =
        Batcher::spawn(4, 4, |_inputs: Vec<u32>| async { Vec::<Result<u32, StorageError>>::new() });
    assert_eq!(batcher.submit(1).await.unwrap_err().kind(), StorageErrorKind::Other);
}

/// A write queued by a task that was ready to run when the worker woke joins the batch of the
/// write that woke it (the worker lets the ready tasks go first, once).
///
/// On tokio 1.54 two ready writers make one batch even without that yield, so this guards the
/// outcome, not the yield; the yield's effect shows in W6 (single reply writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_write_queued_by_a_ready_task_joins_the_batch() {
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let batcher = Arc::new(Batcher::spawn(64, 32, {
        let sizes = Arc::clone(&sizes);
        move |inputs: Vec<u32>| {
            sizes.lock().unwrap().push(inputs.len());
            async move { inputs.into_iter().map(Ok).collect() }
        }
    }));
    // The worker waits for writes.
    assert_eq!(batcher.submit(99).await.unwrap(), 99);
    // Both tasks are ready before either runs; the first one's write wakes the worker. The
    // runtime's one worker thread is held while they are spawned: otherwise it could run the
    // first and the batch before the second is spawned.
    let (held, hold) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let holder = tokio::spawn(async move {
        held.send(()).unwrap();
        released.recv().unwrap();
    });
    hold.recv().unwrap();
    let writers: Vec<_> = (0..2)
        .map(|input| {
            let batcher = Arc::clone(&batcher);
            tokio::spawn(async move { batcher.submit(input).await })
        })
        .collect();
    release.send(()).unwrap();
    holder.await.unwrap();
    for (input, writer) in writers.into_iter().enumerate() {
        assert_eq!(writer.await.unwrap().unwrap(), u32::try_from(input).unwrap());
    }
    assert_eq!(*sizes.lock().unwrap(), [1, 2], "the warm-up, then one batch");
}
