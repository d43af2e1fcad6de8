//! One scenario per rule and boundary. Time moves only with `advance`; the engine runs in
//! durable mode with its log in memory, so `restart` replays it.

mod dead_letter_forwarding_recovery;
mod delivery;
mod entities;
mod expiry_sessions;
