"""Entities created through the administration API survive a restart of a durable broker.

Run in two phases around the restart: SB_PHASE=create, then SB_PHASE=check.
"""

import datetime
import os

from azure.servicebus.management import ServiceBusAdministrationClient, SqlRuleFilter

from test_admin import admin_conn_str  # noqa: E402  (same directory's parent)


def test_admin_entities_survive_a_restart():
    with ServiceBusAdministrationClient.from_connection_string(
        admin_conn_str(), retry_total=0
    ) as admin:
        if os.environ["SB_PHASE"] == "create":
            admin.create_queue("kept-q", max_delivery_count=4, lock_duration=datetime.timedelta(seconds=20))
            admin.create_topic("kept-t")
            admin.create_subscription("kept-t", "kept-s", max_delivery_count=6)
            admin.create_rule("kept-t", "kept-s", "kept-r", filter=SqlRuleFilter("n > 1"))
        else:
            q = admin.get_queue("kept-q")
            assert q.max_delivery_count == 4
            assert q.lock_duration == datetime.timedelta(seconds=20)
            assert admin.get_subscription("kept-t", "kept-s").max_delivery_count == 6
            rules = {r.name: r for r in admin.list_rules("kept-t", "kept-s")}
            assert rules["kept-r"].filter.sql_expression == "n > 1"
