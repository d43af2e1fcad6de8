//! Inbox stores for twice on sqlx.
