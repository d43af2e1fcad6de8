//! One scenario per edge of the pipeline, each with what the processor must do there.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use twice::{
    BoxFuture, Context, HandlerError, HandlerFn, MISSING_MESSAGE_ID, Message, MessageId, Outcome,
    Processor, ProcessorOptions, RetryPolicy, handler_fn,
};

use crate::memory::{MemoryInbox, MemoryTransport, MemoryTx, Settled};

/// What the handler does on each call (counted from 1), after writing its work.
#[derive(Clone, Copy, Debug)]
enum Act {
    Complete,
    /// Return a transient error.
    Fail,
    /// Play a failed statement that aborts the transaction, then return `Complete`.
    AbortAndComplete,
    /// Return the store's transient error (a lost connection) with `?`.
    Unavailable,
}

struct Run {
    transport: Arc<MemoryTransport>,
    inbox: Arc<MemoryInbox>,
    calls: Arc<AtomicUsize>,
    /// The redelivery count each call saw on its message.
    redeliveries_seen: Arc<std::sync::Mutex<Vec<u32>>>,
}

impl Run {
    fn new(inbox: MemoryInbox) -> Self {
        Self {
            transport: Arc::new(MemoryTransport::new()),
            inbox: Arc::new(inbox),
            calls: Arc::default(),
            redeliveries_seen: Arc::default(),
        }
    }

    /// Runs a processor whose handler acts as `script` says on each call until `settlements`
    /// messages are settled; returns the counters.
    async fn until_settled(
        &self,
        script: &'static [Act],
        options: ProcessorOptions,
        settlements: usize,
    ) -> twice::CounterSnapshot {
        let calls = self.calls.clone();
        let seen = self.redeliveries_seen.clone();
        let handler = handler_fn(move |ctx: Context<'_>, tx: &mut MemoryTx| {
            let call = calls.fetch_add(1, Ordering::SeqCst);
            seen.lock().expect("seen").push(twice::redelivery_count(ctx.message()));
            let act = script.get(call).copied().unwrap_or(Act::Complete);
            let order = ctx.message_id().to_string();
            Box::pin(async move {
                tx.work.push(order);
                match act {
                    Act::Complete => Ok(Outcome::Complete),
                    Act::Fail => Err(HandlerError::transient(std::io::Error::other("downstream"))),
                    Act::AbortAndComplete => {
                        tx.aborted = true;
                        Ok(Outcome::Complete)
                    }
                    Act::Unavailable => Err(crate::memory::MemoryError::Unavailable.into()),
                }
            }) as BoxFuture<'_, _>
        });
        let processor: Processor<_, _, HandlerFn<_>> = Processor::from_arcs(
            self.transport.clone(),
            self.inbox.clone(),
            Arc::new(handler),
            options.max_wait(Duration::from_millis(20)),
        );
        let counters = processor.counters();
        let transport = self.transport.clone();
        let settled = async move {
            for _ in 0..10_000 {
                if transport.settled().len() >= settlements {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            panic!("gave up waiting for {settlements} settlements: {:?}", transport.settled());
        };
        processor.run(settled).await.expect("run");
        counters.snapshot()
    }
}

fn order(id: &str) -> Message {
    Message::new("{}").with_message_id(id)
}

fn fast_backoff() -> RetryPolicy {
    RetryPolicy::new().backoff(Duration::from_millis(1), Duration::from_millis(4))
}

#[tokio::test]
async fn messages_without_an_id_are_dead_lettered_never_merged() {
    let run = Run::new(MemoryInbox::default());
    run.transport.send(Message::new("{}"));
    run.transport.send(Message::new("{}"));
    run.transport.send(order(""));
    let s = run.until_settled(&[], ProcessorOptions::new(), 3).await;
    for (_, count, how) in run.transport.settled() {
        assert!(
            matches!(&how, Settled::DeadLetter(r) if r.reason == MISSING_MESSAGE_ID),
            "{how:?}"
        );
        assert_eq!(count, 1, "at once");
    }
    assert_eq!(run.calls.load(Ordering::SeqCst), 0);
    assert_eq!((s.completed, s.dead_lettered), (0, 3), "{s:?}");
    assert_eq!(run.inbox.claims(), 0);
}

#[tokio::test]
async fn an_aborted_transaction_is_a_handler_error_not_a_completion() {
    let run = Run::new(MemoryInbox::default());
    run.transport.send(order("order-1"));
    let s = run.until_settled(&[Act::AbortAndComplete], ProcessorOptions::new(), 2).await;
    assert_eq!(
        run.transport.settled().iter().map(|(_, n, how)| (*n, how.clone())).collect::<Vec<_>>(),
        [(1, Settled::Abandon), (2, Settled::Complete)]
    );
    assert_eq!(run.inbox.work(), ["order-1"], "completed with its work, once");
    assert_eq!((s.handler_errors, s.committed), (1, 1), "{s:?}");
}

#[tokio::test]
async fn infrastructure_failures_are_retried_in_process_without_a_delivery() {
    let inbox = MemoryInbox::default();
    inbox.faults.begin_failures.store(3, Ordering::SeqCst);
    let run = Run::new(inbox);
    run.transport.send(order("order-2"));
    let s = run.until_settled(&[], ProcessorOptions::new().retry(fast_backoff()), 1).await;
    assert_eq!(run.transport.settled(), [(Some(MessageId::new("order-2")), 1, Settled::Complete)]);
    assert_eq!((s.infrastructure_retries, s.abandoned, s.received), (3, 0, 1), "{s:?}");
    assert_eq!(run.inbox.work(), ["order-2"]);
}

/// The retries are used up before any handler ran (no transaction could begin): the message
/// is released, not abandoned, so it comes back with its delivery count unchanged.
#[tokio::test]
async fn infrastructure_retries_used_up_before_the_handler_release_the_message() {
    let inbox = MemoryInbox::default();
    inbox.faults.begin_failures.store(3, Ordering::SeqCst);
    let run = Run::new(inbox);
    run.transport.send(order("order-3"));
    let retry = fast_backoff().infrastructure_retries(2);
    let s = run.until_settled(&[], ProcessorOptions::new().retry(retry), 2).await;
    let how: Vec<_> = run.transport.settled().into_iter().map(|(_, n, how)| (n, how)).collect();
    assert_eq!(how, [(1, Settled::Release), (1, Settled::Complete)]);
    assert_eq!((s.infrastructure_retries, s.abandoned, s.released), (2, 0, 1), "{s:?}");
}

/// A claim the store refuses with an error it does not classify (a read-only database after a
/// failover) is never the message's fault: retried in process, then released, never
/// abandoned; the handler runs once, when the store takes the claim.
#[tokio::test]
async fn a_claim_error_is_retried_and_never_spends_a_delivery() {
    let inbox = MemoryInbox::default();
    inbox.faults.claim_failures.store(6, Ordering::SeqCst);
    let run = Run::new(inbox);
    run.transport.send(order("order-5"));
    let retry = fast_backoff().infrastructure_retries(2);
    let s = run.until_settled(&[], ProcessorOptions::new().retry(retry), 3).await;
    let how: Vec<_> = run.transport.settled().into_iter().map(|(_, n, how)| (n, how)).collect();
    assert_eq!(how, [(1, Settled::Release), (1, Settled::Release), (1, Settled::Complete)]);
    assert_eq!((s.abandoned, s.released, s.committed), (0, 2, 1), "{s:?}");
    assert_eq!(run.calls.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// The retries are used up after the handler ran (its statements met a lost connection each
/// time): the message is abandoned, as a handler that cannot get through is.
#[tokio::test]
async fn infrastructure_retries_used_up_after_the_handler_abandon_the_message() {
    let run = Run::new(MemoryInbox::default());
    run.transport.send(order("order-6"));
    let retry = fast_backoff().infrastructure_retries(2);
    let script = &[Act::Unavailable, Act::Unavailable, Act::Unavailable];
    let s = run.until_settled(script, ProcessorOptions::new().retry(retry), 2).await;
    let how: Vec<_> = run.transport.settled().into_iter().map(|(_, n, how)| (n, how)).collect();
    assert_eq!(how, [(1, Settled::Abandon), (2, Settled::Complete)]);
    assert_eq!((s.infrastructure_retries, s.abandoned), (2, 1), "{s:?}");
}

/// A received message whose lock ran out before a handler took it (it waited behind others in
/// a prefetch buffer) is not handled, since the broker delivers it again; it is counted.
#[tokio::test]
async fn a_message_whose_lock_ran_out_before_a_handler_took_it_is_counted_not_handled() {
    let run = Run::new(MemoryInbox::default());
    let mut stale = twice::ReceivedMessage::new(
        order("order-stale"),
        twice::SequenceNumber::new(1),
        twice::Timestamp::from_millis(0),
    );
    stale.locked_until = Some(twice::Timestamp::from_millis(1));
    run.transport.push(stale);
    run.transport.send(order("order-7"));
    let s = run.until_settled(&[], ProcessorOptions::new(), 1).await;
    assert_eq!(run.transport.settled(), [(Some(MessageId::new("order-7")), 1, Settled::Complete)]);
    assert_eq!((s.expired_in_buffer, s.received), (1, 1), "{s:?}");
    assert_eq!(run.inbox.work(), ["order-7"]);
}

/// A commit whose outcome the processor cannot know (the connection broke after the server
/// committed) is retried; the retry's claim finds the commit and completes as a duplicate.
#[tokio::test]
async fn a_commit_of_unknown_outcome_is_settled_by_the_claim() {
    let inbox = MemoryInbox::default();
    inbox.faults.commits_lost_after.store(1, Ordering::SeqCst);
    let run = Run::new(inbox);
    run.transport.send(order("order-4"));
    let s = run.until_settled(&[], ProcessorOptions::new().retry(fast_backoff()), 1).await;
    assert_eq!(run.transport.settled(), [(Some(MessageId::new("order-4")), 1, Settled::Complete)]);
    assert_eq!(run.calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(run.inbox.work(), ["order-4"]);
    assert_eq!(s.infrastructure_retries, 1, "{s:?}");
    assert_eq!(s.duplicates_already_processed + s.duplicates_concurrent_copy, 1, "{s:?}");
}

#[tokio::test]
async fn handler_errors_are_retried_at_once_then_redelivered_later_then_abandoned() {
    let run = Run::new(MemoryInbox::default());
    run.transport.send(order("order-5"));
    let retry = RetryPolicy::new()
        .immediate_retries(1)
        .delayed_redelivery([Duration::from_secs(10), Duration::from_secs(60)]);
    const SCRIPT: &[Act] = &[Act::Fail; 7];
    let s = run.until_settled(SCRIPT, ProcessorOptions::new().retry(retry), 4).await;
    let how: Vec<_> = run.transport.settled().into_iter().map(|(_, n, how)| (n, how)).collect();
    assert_eq!(
        how,
        [
            (1, Settled::RedeliverLater(Duration::from_secs(10))),
            (1, Settled::RedeliverLater(Duration::from_secs(60))),
            (1, Settled::Abandon),
            (2, Settled::Complete),
        ],
        "two attempts per delivery; the delays in turn, then the broker's own redelivery"
    );
    // Three deliveries of two failed calls each, then the seventh call fails and its
    // immediate retry succeeds.
    assert_eq!(run.calls.load(Ordering::SeqCst), 8);
    assert_eq!((s.immediate_retries, s.delayed_redeliveries), (4, 2), "{s:?}");
    assert_eq!(run.inbox.work(), ["order-5"]);
}

#[tokio::test]
async fn without_delayed_redelivery_in_the_transport_a_handler_error_abandons() {
    let run = Run::new(MemoryInbox::default());
    run.transport.redeliver_later_supported.store(false, Ordering::SeqCst);
    run.transport.send(order("order-6"));
    let retry = RetryPolicy::new().delayed_redelivery([Duration::from_secs(10)]);
    let s = run.until_settled(&[Act::Fail], ProcessorOptions::new().retry(retry), 2).await;
    let how: Vec<_> = run.transport.settled().into_iter().map(|(_, n, how)| (n, how)).collect();
    assert_eq!(how, [(1, Settled::Abandon), (2, Settled::Complete)]);
    assert_eq!((s.abandoned, s.delayed_redeliveries), (1, 0), "{s:?}");
}

#[tokio::test]
async fn the_redelivery_count_travels_with_the_message() {
    let run = Run::new(MemoryInbox::default());
    run.transport.send(order("order-7"));
    let retry = RetryPolicy::new().delayed_redelivery([Duration::from_secs(1)]);
    let s = run.until_settled(&[Act::Fail], ProcessorOptions::new().retry(retry), 2).await;
    assert_eq!(s.delayed_redeliveries, 1, "{s:?}");
    assert_eq!(*run.redeliveries_seen.lock().expect("seen"), [0, 1]);
}

/// Two copies of one message in flight at once: the second claim waits for the first
/// transaction, then finds it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_at_once_do_the_work_once() {
    let run = Run::new(MemoryInbox::default());
    for _ in 0..2 {
        run.transport.send(order("order-8"));
    }
    let s = run.until_settled(&[], ProcessorOptions::new().max_concurrent_calls(2), 2).await;
    assert!(run.transport.settled().iter().all(|(_, _, how)| *how == Settled::Complete));
    assert_eq!(run.calls.load(Ordering::SeqCst), 1);
    assert_eq!(run.inbox.work(), ["order-8"]);
    assert_eq!(s.duplicates_already_processed + s.duplicates_concurrent_copy, 1, "{s:?}");
}

#[tokio::test]
async fn a_store_with_fewer_connections_than_calls_is_refused() {
    let mut inbox = MemoryInbox::default();
    inbox.connections = Some(2);
    let run = Run::new(inbox);
    let handler = handler_fn(|_: Context<'_>, _: &mut MemoryTx| {
        Box::pin(async { Ok(Outcome::Complete) }) as BoxFuture<'_, _>
    });
    let p = Processor::from_arcs(
        run.transport.clone(),
        run.inbox.clone(),
        Arc::new(handler),
        ProcessorOptions::new().max_concurrent_calls(3),
    );
    let err = p.check().expect_err("refused");
    assert!(err.to_string().contains("2 connections, fewer than MaxConcurrentCalls 3"), "{err}");
}

/// Dedup-only mode, two copies at once: the first records the id and is still working when
/// the second meets the record; then the first fails for good (dead-lettered) and removes its
/// record. The second copy must not have been completed as a duplicate of work that never
/// happened: it waits for the first copy's outcome, then does the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_only_a_copy_meeting_a_record_in_progress_waits_for_its_outcome() {
    let run = Run::new(MemoryInbox::default());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let calls = run.calls.clone();
    let handler = handler_fn({
        let gate = gate.clone();
        move |ctx: Context<'_>, tx: &mut MemoryTx| {
            let call = calls.fetch_add(1, Ordering::SeqCst);
            let gate = gate.clone();
            let order = ctx.message_id().to_string();
            Box::pin(async move {
                tx.work.push(order);
                if call == 0 {
                    gate.acquire().await.expect("gate").forget();
                    return Err(HandlerError::permanent("Refused", std::io::Error::other("no")));
                }
                Ok(Outcome::Complete)
            }) as BoxFuture<'_, _>
        }
    });
    let p = Processor::from_arcs(
        run.transport.clone(),
        run.inbox.clone(),
        Arc::new(handler),
        ProcessorOptions::new()
            .mode(twice::Mode::DedupOnly)
            .max_concurrent_calls(2)
            .max_wait(Duration::from_millis(20))
            .retry(
                RetryPolicy::new().backoff(Duration::from_millis(20), Duration::from_millis(20)),
            ),
    );
    let counters = p.counters();
    let transport = run.transport.clone();
    let settled = async move {
        for _ in 0..10_000 {
            if transport.settled().len() >= 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("gave up waiting for 2 settlements: {:?}", transport.settled());
    };
    let task = tokio::spawn(p.run(settled));
    run.transport.send(order("order-9"));
    while run.calls.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    run.transport.send(order("order-9"));
    while counters.snapshot().completed == 0 && counters.snapshot().infrastructure_retries == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    gate.add_permits(1);
    task.await.expect("join").expect("run");
    let how: Vec<_> = run.transport.settled().into_iter().map(|(_, _, how)| how).collect();
    assert!(
        how.contains(&Settled::Complete) && how.iter().any(|h| matches!(h, Settled::DeadLetter(_))),
        "{how:?}"
    );
    assert_eq!(
        run.inbox.work(),
        ["order-9"],
        "the completed copy has its work: {:?}",
        counters.snapshot()
    );
}
