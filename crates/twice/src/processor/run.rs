//! [`Processor`] and its run loop: receive, and process each message in a task of its own.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument as _;

use super::Mode;
use super::base::{processor_type, report_join};
use super::batch::process_batch;
use super::lock::{LockState, fixed_limit, keep_lock, keeping_locks, renewal_margin};
use super::options::ProcessorOptions;
use super::settle::TransportSettler;
use super::shared::Core;
use crate::clock::Timestamp;
use crate::counters::{Counter, InFlight};
use crate::error::{ErrorSource, ProcessError, ProcessorError};
use crate::handler::Handler;
use crate::inbox::Inbox;
use crate::transport::{Delivery, Transport, TransportError};

processor_type! {
    /// Receives messages from a [`Transport`] and runs a [`Handler`] on each, in the inbox
    /// transaction of an [`Inbox`]; see the [module docs](crate::processor).
    pub struct Processor<T: Transport> { options: ProcessorOptions }

    /// A processor of `transport`'s messages with `handler`, claiming in `inbox`.
    fn new;

    /// Runs until `shutdown` resolves: receives messages and processes up to
    /// MaxConcurrentCalls of them at once, each in a task that owns a semaphore permit until
    /// its transaction has ended; its settlement then goes on under a permit of a second
    /// semaphore, as large, and frees the call (see the [module docs](crate::processor)). On
    /// shutdown it stops receiving, releases prefetched messages no handler has taken, and
    /// waits for the messages in flight to finish (or roll back when their lock is lost) and
    /// for every pending settlement.
    ///
    /// # Errors
    ///
    /// Refuses to start when [`Processor::check`] fails; stops with
    /// [`ProcessorError::Transport`] when the transport closes.
    ///
    /// # Cancel safety
    ///
    /// Resolve `shutdown` to stop: `run` then finishes what is in flight and every pending
    /// settlement before it returns. Dropping the future instead (a `select!` branch that
    /// loses, an aborted task, a runtime shut down) stops everything where it is, without
    /// waiting: the handlers in flight are dropped and their transactions roll back; a
    /// settlement already handed to the transport may still reach the broker, one not yet
    /// handed over never does. Nothing is done twice and nothing is lost: a message whose
    /// work committed but whose completion did not go out comes back when its lock runs out,
    /// meets its claim and completes as a duplicate; a message rolled back, or received and
    /// not yet taken, comes back when its lock runs out, with a delivery counted for it.
    fn run;
}

impl<T, I, H> Processor<T, I, H>
where
    T: Transport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    /// The receive loop of [`Processor::run`], after the check.
    async fn serve(
        transport: Arc<T>,
        options: ProcessorOptions,
        core: Arc<Core<I, H>>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ProcessorError> {
        let batch_size = options.get_batch_size();
        check_batch_size(batch_size, core.mode, core.inbox.supports_batches())?;
        let clock = options.get_clock().clone();
        let semaphore = Arc::new(Semaphore::new(options.get_max_concurrent_calls()));
        // Settlements pending after their transaction has ended, counted apart from the calls.
        let settlements = Arc::new(Semaphore::new(options.get_max_concurrent_calls()));
        let mut tasks = JoinSet::new();
        let mut buffer: VecDeque<(T::Delivery, Timestamp)> = VecDeque::new();
        let mut shutdown = std::pin::pin!(shutdown);

        let result = loop {
            while let Some(joined) = tasks.try_join_next() {
                report_join(&core, joined);
            }
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                p = Arc::clone(&semaphore).acquire_owned() => match p {
                    Ok(p) => p,
                    // The semaphore is never closed; stop rather than spin if it were.
                    Err(_) => break Ok(()),
                },
            };
            if buffer.is_empty() {
                let want = ((semaphore.available_permits() + 1) * batch_size)
                    .max(options.get_prefetch_count());
                core.activity.receive_started(clock.now());
                let received = tokio::select! {
                    biased;
                    () = &mut shutdown => break Ok(()),
                    r = transport.receive(want, options.get_max_wait()) => r,
                };
                match received {
                    Ok(deliveries) => {
                        let now = clock.now();
                        core.activity.received(now);
                        buffer.extend(deliveries.into_iter().map(|d| (d, now)));
                    }
                    Err(TransportError::Closed) => {
                        break Err(ProcessorError::Transport(TransportError::Closed));
                    }
                    Err(e) => {
                        core.report(ProcessError::new(ErrorSource::Receive, None, e));
                        // Back off a little so a broken connection does not spin the loop.
                        tokio::select! {
                            biased;
                            () = &mut shutdown => break Ok(()),
                            () = clock.sleep(Duration::from_secs(1)) => {}
                        }
                    }
                }
            }
            // Up to a batch of the messages already received, skipping those whose lock ran
            // out while they waited in the prefetch buffer: the broker delivers them again
            // (with a delivery counted), so they must not be processed here. Counted, since a
            // prefetch too deep for the handlers' pace burns deliveries this way.
            let mut taken = Vec::new();
            while taken.len() < batch_size {
                let Some((delivery, received_at)) = buffer.pop_front() else { break };
                if let Some(until) = delivery.message().locked_until.filter(|u| *u <= clock.now()) {
                    core.counters.inc(Counter::ExpiredInBuffer);
                    tracing::debug!(
                        message_id = %delivery.message().message_id(),
                        locked_until = %until,
                        delivery_count = delivery.message().delivery_count,
                        "the lock of a received message ran out before a handler took it; skipped"
                    );
                    continue;
                }
                taken.push((delivery, received_at));
            }
            if taken.len() > 1 {
                tasks.spawn(process_batch(
                    Arc::clone(&core),
                    Arc::clone(&transport),
                    taken,
                    options.get_max_auto_lock_renewal_duration(),
                    permit,
                    Arc::clone(&settlements),
                ));
                continue;
            }
            let Some((delivery, received_at)) = taken.pop() else { continue };
            let span = core.span(delivery.message());
            tasks.spawn(
                process_one(
                    Arc::clone(&core),
                    Arc::clone(&transport),
                    delivery,
                    received_at,
                    options.get_max_auto_lock_renewal_duration(),
                    permit,
                    Arc::clone(&settlements),
                )
                .instrument(span),
            );
        };

        for (delivery, _) in buffer.drain(..) {
            match transport.release(&delivery).await {
                Ok(()) => core.counters.inc(Counter::Released),
                // Without release the lock simply runs out; nothing is lost.
                Err(TransportError::Unsupported(_)) => {}
                Err(e) => core.report(ProcessError::new(
                    ErrorSource::Settle,
                    Some(delivery.message().message_id()),
                    e,
                )),
            }
        }
        while let Some(joined) = tasks.join_next().await {
            report_join(&core, joined);
        }
        result
    }
}

/// One message in its own task: processing raced against the loss of its lock, then its
/// settlement.
///
/// The call (`call`, a permit of MaxConcurrentCalls) is held until the transaction has ended.
/// The settlement then waits for a permit of `settlements` and frees the call, so the next
/// message's handler starts while this one's settlement travels to the broker; the lock is
/// kept for as long as the settlement takes.
async fn process_one<T, I, H>(
    core: Arc<Core<I, H>>,
    transport: Arc<T>,
    delivery: T::Delivery,
    received_at: Timestamp,
    max_renewal: Duration,
    call: OwnedSemaphorePermit,
    settlements: Arc<Semaphore>,
) where
    T: Transport,
    I: Inbox,
    H: Handler<I::Tx>,
{
    let _in_flight = InFlight::new(&core.counters);
    let lock = LockState::new(delivery.message().locked_until);
    let id = delivery.message().message_id().clone();
    let margin = renewal_margin(transport.entity().lock_duration);
    let limit = fixed_limit(received_at + max_renewal);
    let settler = TransportSettler(Arc::clone(&transport));
    let keeper =
        keep_lock(&core, &lock, limit, margin, Some(&id), || transport.renew_lock(&delivery));
    let mut keeper = std::pin::pin!(keeper);
    let verdict = core.verdict(delivery.message(), received_at, &lock, keeper.as_mut()).await;
    if !verdict.settles() {
        core.settle(&settler, &delivery, verdict).await;
        return;
    }
    let settle = async {
        // Waiting here with the call still held bounds the messages between their commit and
        // the end of their settlement to MaxConcurrentCalls.
        let slot = settlements.acquire().await;
        drop(call);
        core.settle(&settler, &delivery, verdict).await;
        drop(slot);
    };
    // The keeper renews the lock until the settlement is done. Once the lock is lost the
    // settlement goes on, and fails as a lock lost if the broker says so (reported, and the
    // redelivery meets the claim).
    keeping_locks(settle, keeper).await;
}

/// Refuses a batch size of 0, and batches where they cannot be kept: outside [`Mode::Claim`],
/// or with an inbox that cannot roll one handler's work back alone.
fn check_batch_size(batch_size: usize, mode: Mode, supported: bool) -> Result<(), ProcessorError> {
    let refused = match batch_size {
        0 => "the batch size must be at least 1",
        1 => return Ok(()),
        _ if mode != Mode::Claim => {
            "batches need Mode::Claim: a batch claims its messages in one statement"
        }
        _ if !supported => {
            "this inbox does not support batches (Inbox::supports_batches): it cannot roll one \
             handler's work back alone"
        }
        _ => return Ok(()),
    };
    Err(ProcessorError::InvalidOptions(format!("batch_size {batch_size}: {refused}")))
}
