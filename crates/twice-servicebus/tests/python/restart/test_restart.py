"""Run in two phases around a broker restart: SB_PHASE=send, then SB_PHASE=receive."""

import os

from azure.servicebus import ServiceBusClient, ServiceBusMessage

COUNT = 25


def test_phase():
    phase = os.environ["SB_PHASE"]
    with ServiceBusClient.from_connection_string(os.environ["SB_CONNECTION_STRING"], retry_total=0) as c:
        if phase == "send":
            with c.get_queue_sender("q17") as s:
                for i in range(COUNT):
                    s.send_messages(ServiceBusMessage(f"durable-{i}".encode(), message_id=f"d{i}"))
            return
        assert phase == "receive"
        got = []
        with c.get_queue_receiver("q17", max_wait_time=5) as r:
            while len(got) < COUNT:
                msgs = r.receive_messages(max_message_count=10, max_wait_time=5)
                assert msgs, f"only {len(got)} of {COUNT} messages came back after the restart"
                for m in msgs:
                    got.append(b"".join(m.body).decode())
                    r.complete_message(m)
        assert sorted(got) == sorted(f"durable-{i}" for i in range(COUNT))
