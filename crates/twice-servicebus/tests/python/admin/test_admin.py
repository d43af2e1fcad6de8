"""The administration API with `ServiceBusAdministrationClient` (azure-servicebus 7.15).

The client is configured from the emulator connection string pointed at the HTTP port, and
nothing else: the SDK's administration client always speaks https (it ignores
`UseDevelopmentEmulator`), and the port speaks https beside http with the server's development
certificate, whose CA the environment trusts (`REQUESTS_CA_BUNDLE`, as `twice serve` prints).
"""

import datetime
import os
import uuid

import pytest
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.management import (
    CorrelationRuleFilter,
    ServiceBusAdministrationClient,
    SqlRuleAction,
    SqlRuleFilter,
)


def admin_conn_str(key="SAS_KEY_VALUE"):
    port = os.environ["SB_HTTP"].rsplit(":", 1)[1]
    return (
        f"Endpoint=sb://localhost:{port};SharedAccessKeyName=RootManageSharedAccessKey;"
        f"SharedAccessKey={key};UseDevelopmentEmulator=true;"
    )


@pytest.fixture
def admin():
    with ServiceBusAdministrationClient.from_connection_string(
        admin_conn_str(), retry_total=0
    ) as a:
        yield a


def name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_queue_create_get_update_list_delete(admin):
    q = name("adminq")
    created = admin.create_queue(q, max_delivery_count=7, lock_duration=datetime.timedelta(seconds=30))
    assert created.name == q
    assert created.max_delivery_count == 7
    assert created.lock_duration == datetime.timedelta(seconds=30)
    # What the body left out has the Service Bus defaults.
    assert created.requires_session is False
    assert created.max_size_in_megabytes == 1024
    assert created.duplicate_detection_history_time_window == datetime.timedelta(minutes=10)

    with pytest.raises(ResourceExistsError):
        admin.create_queue(q)

    got = admin.get_queue(q)
    got.max_delivery_count = 3
    got.dead_lettering_on_message_expiration = True
    admin.update_queue(got)
    again = admin.get_queue(q)
    assert again.max_delivery_count == 3
    assert again.dead_lettering_on_message_expiration is True
    assert again.lock_duration == datetime.timedelta(seconds=30)

    names = [x.name for x in admin.list_queues()]
    assert q in names and "q1" in names

    admin.delete_queue(q)
    with pytest.raises(ResourceNotFoundError):
        admin.get_queue(q)
    with pytest.raises(ResourceNotFoundError):
        admin.delete_queue(q)


def test_out_of_range_properties_are_refused(admin):
    with pytest.raises(HttpResponseError) as e:
        admin.create_queue(name("badq"), lock_duration=datetime.timedelta(hours=1))
    assert e.value.status_code == 400
    assert "LockDuration" in str(e.value)


def test_queue_runtime_properties_count_messages(admin, conn_str):
    q = name("countq")
    admin.create_queue(q)
    with ServiceBusClient.from_connection_string(conn_str) as client:
        with client.get_queue_sender(q) as sender:
            sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(3)])
            at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
            sender.schedule_messages(ServiceBusMessage("later"), at)
        with client.get_queue_receiver(q, max_wait_time=5) as receiver:
            [m] = receiver.receive_messages(max_message_count=1)
            receiver.dead_letter_message(m, reason="test")
    rt = admin.get_queue_runtime_properties(q)
    assert rt.active_message_count == 2
    assert rt.dead_letter_message_count == 1
    assert rt.scheduled_message_count == 1
    assert rt.transfer_message_count == 0
    assert rt.transfer_dead_letter_message_count == 0
    assert rt.total_message_count == 4
    assert rt.created_at_utc is not None and rt.updated_at_utc >= rt.created_at_utc
    listed = {x.name: x for x in admin.list_queues_runtime_properties()}
    assert listed[q].active_message_count == 2
    admin.delete_queue(q)


def test_topic_subscription_and_sql_rule_with_action(admin, conn_str):
    t = name("admint")
    admin.create_topic(t, default_message_time_to_live=datetime.timedelta(hours=1))
    topic = admin.get_topic(t)
    assert topic.default_message_time_to_live == datetime.timedelta(hours=1)
    topic.default_message_time_to_live = datetime.timedelta(hours=2)
    admin.update_topic(topic)
    assert admin.get_topic(t).default_message_time_to_live == datetime.timedelta(hours=2)
    assert t in [x.name for x in admin.list_topics()]

    sub = admin.create_subscription(t, "red", max_delivery_count=5)
    assert sub.max_delivery_count == 5
    got = admin.get_subscription(t, "red")
    got.max_delivery_count = 4
    admin.update_subscription(t, got)
    assert admin.get_subscription(t, "red").max_delivery_count == 4
    assert [s.name for s in admin.list_subscriptions(t)] == ["red"]
    assert admin.get_topic_runtime_properties(t).subscription_count == 1

    # A new subscription has the $Default rule; replace it with a SQL rule that has an action.
    assert [r.name for r in admin.list_rules(t, "red")] == ["$Default"]
    admin.create_rule(
        t, "red", "reds",
        filter=SqlRuleFilter("color = 'red'"),
        action=SqlRuleAction("SET marked = 'yes'"),
    )
    admin.delete_rule(t, "red", "$Default")
    rule = admin.get_rule(t, "red", "reds")
    assert rule.filter.sql_expression == "color = 'red'"
    assert rule.action.sql_expression == "SET marked = 'yes'"
    with pytest.raises(ResourceExistsError):
        admin.create_rule(t, "red", "reds", filter=SqlRuleFilter("1=1"))

    rule.filter = SqlRuleFilter("color = 'red' OR color = 'crimson'")
    admin.update_rule(t, "red", rule)
    assert admin.get_rule(t, "red", "reds").filter.sql_expression == "color = 'red' OR color = 'crimson'"

    admin.create_rule(t, "red", "corr", filter=CorrelationRuleFilter(correlation_id="c-9", properties={"n": 5}))
    corr = admin.get_rule(t, "red", "corr")
    assert corr.filter.correlation_id == "c-9"
    assert corr.filter.properties == {"n": 5}
    admin.delete_rule(t, "red", "corr")
    assert [r.name for r in admin.list_rules(t, "red")] == ["reds"]

    # The rules route messages as created: only the red one arrives, marked by the action.
    with ServiceBusClient.from_connection_string(conn_str) as client:
        with client.get_topic_sender(t) as sender:
            sender.send_messages(ServiceBusMessage("r", application_properties={"color": "red"}))
            sender.send_messages(ServiceBusMessage("b", application_properties={"color": "blue"}))
        with client.get_subscription_receiver(t, "red", max_wait_time=3) as receiver:
            got = receiver.receive_messages(max_message_count=5, max_wait_time=3)
            assert [str(m) for m in got] == ["r"]
            assert got[0].application_properties[b"marked"] == b"yes"
            receiver.complete_message(got[0])

    admin.delete_subscription(t, "red")
    with pytest.raises(ResourceNotFoundError):
        admin.get_subscription(t, "red")
    admin.delete_topic(t)
    with pytest.raises(ResourceNotFoundError):
        admin.get_topic(t)


def test_lists_page_through_skip_and_top(admin):
    t = name("paget")
    admin.create_topic(t)
    for i in range(5):
        admin.create_subscription(t, f"s{i}")
    pages = admin.list_subscriptions(t, max_page_size=2).by_page()
    sizes = [len(list(p)) for p in pages]
    assert sizes == [2, 2, 1]
    admin.delete_topic(t)


def test_sample_flow_mgmt_queue(admin):
    # samples/sync_samples/mgmt_queue.py: create, get, update, list, runtime, delete.
    q = name("sampleq")
    admin.create_queue(q)
    props = admin.get_queue(q)
    props.max_delivery_count = 5
    admin.update_queue(props)
    assert admin.get_queue(q).max_delivery_count == 5
    assert q in [x.name for x in admin.list_queues()]
    assert admin.get_queue_runtime_properties(q).total_message_count == 0
    admin.delete_queue(q)


def test_a_wrong_key_is_unauthorized():
    with ServiceBusAdministrationClient.from_connection_string(
        admin_conn_str(key="WRONG"), retry_total=0
    ) as bad:
        with pytest.raises(ClientAuthenticationError):
            bad.get_queue("q1")
        with pytest.raises(ClientAuthenticationError):
            bad.create_queue(name("nope"))
