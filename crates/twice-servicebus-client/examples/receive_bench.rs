//! The raw client's receive + complete rate against `twice serve` in process (in-memory
//! broker): `cargo run --release -p twice-servicebus-client --example receive_bench [N] [CREDIT]`.
//! Prints numbers; it asserts nothing about them.

use std::net::SocketAddr;
use std::time::Duration;

use twice::{Message, Stopwatch};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Server, ServerOptions};
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(20_000), |a| a.parse())?;
    let credit: u32 = args.next().map_or(Ok(100), |a| a.parse())?;
    let broker = Broker::open(BrokerOptions::in_memory()).await?;
    broker.create_queue("bench", QueueProperties::default()).await?;
    let options =
        ServerOptions::new().amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0))).http_addr(None);
    let server = Server::bind(options, broker).await?;
    let cs = server.connection_string();
    tokio::spawn(server.run(std::future::pending()));
    let client = ServiceBusClient::from_connection_string(&cs)?;
    let sender = client.sender("bench");
    let watch = Stopwatch::start();
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        sender.send_batch(chunk.iter().map(|i| Message::new(format!("m{i}"))).collect()).await?;
    }
    let sent = watch.elapsed();
    let receiver = client.receiver("bench", ReceiverOptions::new().prefetch(credit));
    let watch = Stopwatch::start();
    let mut done = 0;
    while done < n {
        let batch =
            receiver.receive_messages(usize::try_from(credit)?, Duration::from_secs(5)).await?;
        if batch.is_empty() {
            break;
        }
        // Settle a batch concurrently, as a processor with many calls does.
        let settles = batch.iter().map(|d| receiver.complete_message(d));
        for r in futures::future::join_all(settles).await {
            r?;
        }
        done += batch.len();
    }
    let took = watch.elapsed();
    println!(
        "sent {n} in batches of 100: {:.0} msg/s; received and completed {done} with credit {credit}: {:.0} msg/s",
        n as f64 / sent.as_secs_f64(),
        done as f64 / took.as_secs_f64()
    );
    Ok(())
}
