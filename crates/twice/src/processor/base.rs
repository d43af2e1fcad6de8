//! What [`Processor`](super::Processor) and [`SessionProcessor`](crate::SessionProcessor)
//! share: the transport, inbox and handler, the counters, the callbacks, the checks at start
//! and the [`Core`] each run builds.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::options::{check_connections, check_retention};
use super::shared::Core;
use super::{BusinessKeyDuplicate, Mode};
use crate::clock::SharedClock;
use crate::counters::Counters;
use crate::error::{ErrorSource, ProcessError, ProcessorError};
use crate::handler::Handler;
use crate::health::{Activity, HealthHandle};
use crate::inbox::Inbox;
use crate::message::ReceivedMessage;
use crate::retry::RetryPolicy;
use crate::transport::Transport;

type ErrorCallback = Arc<dyn Fn(&ProcessError) + Send + Sync>;
type CommitHook = Arc<dyn Fn(&ReceivedMessage) + Send + Sync>;
type BusinessKeyHook = Arc<dyn Fn(&BusinessKeyDuplicate) + Send + Sync>;

/// The callbacks the application sets on a processor.
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    pub(crate) on_error: Option<ErrorCallback>,
    pub(crate) on_committed: Option<CommitHook>,
    pub(crate) on_business_key: Option<BusinessKeyHook>,
}

/// What the shared parts read from a processor's options.
pub(crate) struct Settings<'a> {
    /// The consumer name set, if any (default: the transport's claim scope).
    pub(crate) consumer: Option<&'a str>,
    /// How many messages are in flight at once, and the option that says so.
    pub(crate) concurrency: (usize, &'static str),
    pub(crate) mode: Mode,
    pub(crate) max_auto_lock_renewal_duration: Duration,
    pub(crate) max_wait: Duration,
    pub(crate) retry: &'a RetryPolicy,
    pub(crate) clock: &'a SharedClock,
    /// The oldest dead-lettered message resubmitted, when the application bounds it.
    pub(crate) max_resubmit_age: Option<Duration>,
}

/// The parts a processor is built from, whatever it receives from.
pub(crate) struct Base<T, I, H> {
    pub(crate) transport: Arc<T>,
    pub(crate) inbox: Arc<I>,
    pub(crate) handler: Arc<H>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) activity: Arc<Activity>,
    pub(crate) hooks: Hooks,
}

impl<T: Transport, I: Inbox, H> Base<T, I, H> {
    pub(crate) fn new(transport: Arc<T>, inbox: Arc<I>, handler: Arc<H>) -> Self {
        Self {
            transport,
            inbox,
            handler,
            counters: Arc::default(),
            activity: Arc::default(),
            hooks: Hooks::default(),
        }
    }

    /// A handle on the health of the processor built from these parts.
    pub(crate) fn health_handle(&self, settings: &Settings<'_>) -> HealthHandle {
        HealthHandle::new(
            Arc::clone(&self.activity),
            Arc::clone(&self.inbox),
            settings.clock.clone(),
            settings.max_wait,
        )
    }

    /// Writes `name { transport, inbox, options, .. }`.
    pub(crate) fn debug(
        &self,
        f: &mut fmt::Formatter<'_>,
        name: &str,
        options: &dyn fmt::Debug,
    ) -> fmt::Result {
        f.debug_struct(name)
            .field("transport", &self.transport)
            .field("inbox", &self.inbox)
            .field("options", options)
            .finish_non_exhaustive()
    }

    /// The consumer name the inbox keys are scoped to: the one set, else the transport's
    /// claim scope.
    pub(crate) fn consumer<'a>(&'a self, settings: &Settings<'a>) -> &'a str {
        settings.consumer.unwrap_or_else(|| self.transport.claim_scope())
    }

    /// Checks that the inbox has a connection for every message in flight and, unless the
    /// handler is naturally idempotent, that its retention covers the redelivery horizon.
    pub(crate) fn check(&self, settings: &Settings<'_>) -> Result<(), ProcessorError> {
        let (concurrent, option) = settings.concurrency;
        check_connections(self.inbox.as_ref(), concurrent, option)?;
        self.check_retention(settings).map(drop)
    }

    /// Checks the inbox retention against the redelivery horizon and the resubmits from the
    /// dead-letter queue; returns the warning to log when nothing bounds the latter.
    pub(crate) fn check_retention(
        &self,
        settings: &Settings<'_>,
    ) -> Result<Option<String>, ProcessorError> {
        if settings.mode == Mode::NaturallyIdempotent {
            return Ok(None);
        }
        check_retention(
            self.transport.entity(),
            self.inbox.retention(),
            settings.max_auto_lock_renewal_duration,
            settings.max_resubmit_age,
        )
    }

    /// The pipeline one run shares between its messages.
    pub(crate) fn core(&self, settings: &Settings<'_>) -> Arc<Core<I, H>>
    where
        H: Handler<I::Tx>,
    {
        #[cfg(feature = "metrics")]
        self.counters.label(&self.transport.entity().path, self.consumer(settings));
        Arc::new(Core {
            inbox: Arc::clone(&self.inbox),
            handler: Arc::clone(&self.handler),
            consumer: self.consumer(settings).to_owned(),
            system: self.transport.system(),
            destination: self.transport.entity().path.clone(),
            mode: settings.mode,
            retry: settings.retry.clone(),
            clock: settings.clock.clone(),
            counters: Arc::clone(&self.counters),
            activity: Arc::clone(&self.activity),
            hooks: self.hooks.clone(),
        })
    }
}

/// Reports a task that ended in a panic. Handler panics are caught inside the task; this is a
/// panic in twice itself.
pub(crate) fn report_join<I, H>(core: &Core<I, H>, joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        core.report(ProcessError::new(ErrorSource::Handler, None, e));
    }
}

/// Declares [`Processor`](super::Processor) or [`SessionProcessor`](crate::SessionProcessor):
/// the type (a [`Base`] and the options), its `Debug`, and the public methods both share,
/// written once. `run` checks, builds the [`Core`] and hands over to the type's own `serve`.
macro_rules! processor_type {
    (
        $(#[$doc:meta])*
        pub struct $name:ident<T: $transport:ident> { options: $options:ty }

        $(#[$new_doc:meta])*
        fn new;

        $(#[$run_doc:meta])*
        fn run;
    ) => {
        $(#[$doc])*
        pub struct $name<T: $transport, I: $crate::Inbox, H> {
            base: $crate::processor::Base<T, I, H>,
            options: $options,
        }

        impl<T: $transport, I: $crate::Inbox, H> std::fmt::Debug for $name<T, I, H> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.base.debug(f, stringify!($name), &self.options)
            }
        }

        impl<T, I, H> $name<T, I, H>
        where
            T: $transport,
            I: $crate::Inbox,
            H: $crate::Handler<I::Tx>,
        {
            $(#[$new_doc])*
            pub fn new(transport: T, inbox: I, handler: H, options: $options) -> Self {
                Self::from_arcs(
                    std::sync::Arc::new(transport),
                    std::sync::Arc::new(inbox),
                    std::sync::Arc::new(handler),
                    options,
                )
            }

            /// As [`Self::new`], sharing a transport, inbox or handler with other processors.
            pub fn from_arcs(
                transport: std::sync::Arc<T>,
                inbox: std::sync::Arc<I>,
                handler: std::sync::Arc<H>,
                options: $options,
            ) -> Self {
                Self { base: $crate::processor::Base::new(transport, inbox, handler), options }
            }

            /// Calls `f` with every error that does not stop the processor (receive, claim,
            /// handler, commit, settle, lock renewal), with its source. Without it errors are
            /// logged.
            #[must_use]
            pub fn on_error(
                mut self,
                f: impl Fn(&$crate::ProcessError) + Send + Sync + 'static,
            ) -> Self {
                self.base.hooks.on_error = Some(std::sync::Arc::new(f));
                self
            }

            /// Calls `f` after a message's transaction has committed and before the message
            /// is completed: the window in which a crash leaves committed work and an
            /// unsettled message. For fault injection (the demo, tests) and tracing.
            #[must_use]
            pub fn on_committed(
                mut self,
                f: impl Fn(&$crate::ReceivedMessage) + Send + Sync + 'static,
            ) -> Self {
                self.base.hooks.on_committed = Some(std::sync::Arc::new(f));
                self
            }

            /// Calls `f` for every message completed as a duplicate by business key (besides
            /// the warn-level log line each gets), so the application can count them and
            /// alert.
            #[must_use]
            pub fn on_business_key_duplicate(
                mut self,
                f: impl Fn(&$crate::BusinessKeyDuplicate) + Send + Sync + 'static,
            ) -> Self {
                self.base.hooks.on_business_key = Some(std::sync::Arc::new(f));
                self
            }

            /// The processor's counters, live while it runs.
            pub fn counters(&self) -> std::sync::Arc<$crate::Counters> {
                std::sync::Arc::clone(&self.base.counters)
            }

            /// A handle that checks the processor's health (is it receiving, when did it last
            /// complete a message, does its inbox answer), before, while and after it runs:
            /// take it before [`Self::run`], which consumes the processor.
            pub fn health_handle(&self) -> $crate::HealthHandle {
                self.base.health_handle(&self.options.settings())
            }

            /// The consumer name the inbox keys are scoped to: the one set, else the
            /// transport's [claim scope](crate::processor#claim-scope).
            pub fn consumer(&self) -> &str {
                self.base.consumer(&self.options.settings())
            }

            /// Checks the options against the entity and the inbox: the inbox retention must
            /// cover the redelivery horizon ([`redelivery_horizon`](crate::redelivery_horizon)),
            /// and the inbox must have a connection for every message in flight
            /// (MaxConcurrentCalls, or MaxConcurrentSessions): a message in flight holds one
            /// for its whole transaction, so with fewer the surplus calls only wait for a
            /// connection, and time out.
            ///
            /// # Errors
            ///
            /// [`ProcessorError::RetentionTooShort`](crate::ProcessorError::RetentionTooShort)
            /// or [`ProcessorError::InvalidOptions`](crate::ProcessorError::InvalidOptions),
            /// naming the numbers.
            pub fn check(&self) -> Result<(), $crate::ProcessorError> {
                self.base.check(&self.options.settings())
            }

            $(#[$run_doc])*
            pub async fn run(
                self,
                shutdown: impl std::future::Future<Output = ()> + Send,
            ) -> Result<(), $crate::ProcessorError> {
                // The entity's properties as the broker has them, for the checks and the locks.
                $crate::Transport::read_entity(&*self.base.transport)
                    .await
                    .map_err($crate::ProcessorError::Transport)?;
                self.check()?;
                let settings = self.options.settings();
                if let Ok(Some(warning)) = self.base.check_retention(&settings) {
                    tracing::warn!(entity = %self.base.transport.entity().path, "{warning}");
                }
                let _running = self.base.activity.start();
                let core = self.base.core(&self.options.settings());
                Self::serve(self.base.transport, self.options, core, shutdown).await
            }
        }
    };
}
pub(crate) use processor_type;
