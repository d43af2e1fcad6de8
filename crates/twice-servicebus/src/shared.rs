//! What every connection and the HTTP side port share: the backend, the options (the clock
//! among them) and the counters.

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::options::ServerOptions;

/// What every connection shares.
#[derive(Debug)]
pub(crate) struct Shared<B> {
    pub(crate) backend: B,
    pub(crate) options: ServerOptions,
    pub(crate) metrics: Arc<Metrics>,
}
