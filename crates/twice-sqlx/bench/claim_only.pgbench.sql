\set id random(1, 2000000000)
BEGIN;
INSERT INTO pgb_inbox (consumer, message_id, processed_at_ms) VALUES ('bench', 'm-' || :client_id || '-' || :id, 0) ON CONFLICT (consumer, message_id) DO NOTHING;
COMMIT;
