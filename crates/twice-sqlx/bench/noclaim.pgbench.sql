\set id random(1, 2000000000)
BEGIN;
INSERT INTO pgb_shipments (order_id, message_id) VALUES (:id, 'order-' || :id);
COMMIT;
