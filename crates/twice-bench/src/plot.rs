//! PNG plots with plotters: horizontal bar charts of throughput side by side, and a line chart
//! of claim latency against the size of the inbox. Text is drawn from DejaVu Sans embedded in
//! the binary, so no font need be installed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::results::{BrokerRow, ClaimBench, Recovery, TransportsBench};

const WIDTH: u32 = 1100;
const COLOURS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

fn register_font() -> anyhow::Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        )
        .map_err(|_| anyhow::anyhow!("the embedded DejaVu Sans font did not load"));
    });
    result
}

fn error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("plot: {e}")
}

/// One group of bars (a system or a transport) with one value per series (`None`: no bar).
#[derive(Clone, Debug)]
pub struct Group {
    /// The label left of the group.
    pub label: String,
    /// A second, smaller line under the label (what was durable before the
    /// acknowledgement), if any.
    pub detail: Option<String>,
    /// One value per series.
    pub values: Vec<Option<f64>>,
}

/// A horizontal bar chart: one group of bars per [`Group`], one colour per series.
///
/// # Errors
/// When the file cannot be written or a drawing call fails.
#[allow(clippy::cast_precision_loss)] // reason: slot indices are small
pub fn bar_chart(
    path: &Path,
    title: &str,
    unit: &str,
    series: &[&str],
    groups: &[Group],
) -> anyhow::Result<()> {
    register_font()?;
    let per_group = series.len() + 1; // one empty slot between groups
    let slots = (groups.len() * per_group).max(1);
    let height = u32::try_from(120 + slots * 26).unwrap_or(4000);
    let max = groups
        .iter()
        .flat_map(|g| g.values.iter().flatten())
        .fold(0.0_f64, |a, &b| a.max(b))
        .max(1.0);
    let root = BitMapBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(330)
        .build_cartesian_2d(0.0..max * 1.18, 0.0..slots as f64)
        .map_err(error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc(unit)
        .x_label_formatter(&|x| short(*x))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(error)?;
    for (s, name) in series.iter().enumerate() {
        let colour = COLOURS[s % COLOURS.len()];
        let bars: Vec<(f64, f64, f64)> = groups
            .iter()
            .enumerate()
            .filter_map(|(g, group)| {
                let v = group.values.get(s).copied().flatten()?;
                // Slots count from the top: the first group is drawn first.
                let top = slots as f64 - (g * per_group + s) as f64;
                Some((v, top - 0.9, top - 0.1))
            })
            .collect();
        chart
            .draw_series(
                bars.iter()
                    .map(|&(v, y0, y1)| Rectangle::new([(0.0, y0), (v, y1)], colour.filled())),
            )
            .map_err(error)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], colour.filled()));
        chart
            .draw_series(bars.iter().map(|&(v, y0, y1)| {
                Text::new(
                    if v < 100.0 { format!(" {v:.2}") } else { format!(" {v:.0}") },
                    (v, (y0 + y1) / 2.0),
                    TextStyle::from(("sans-serif", 13).into_font())
                        .pos(Pos::new(HPos::Left, VPos::Center)),
                )
            }))
            .map_err(error)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(error)?;
    // The groups' labels, left of the plotting area, level with the middle of each group.
    let style =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
    let detail_style = TextStyle::from(("sans-serif", 12).into_font())
        .color(&RGBColor(90, 90, 90))
        .pos(Pos::new(HPos::Right, VPos::Center));
    let not_run =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (g, group) in groups.iter().enumerate() {
        let middle = slots as f64 - (g * per_group) as f64 - series.len() as f64 / 2.0;
        let (x, y) = chart.backend_coord(&(0.0, middle));
        let (label_y, detail_y) = if group.detail.is_some() { (y - 8, y + 9) } else { (y, y) };
        root.draw(&Text::new(group.label.clone(), (x - 8, label_y), style.clone()))
            .map_err(error)?;
        if let Some(detail) = &group.detail {
            root.draw(&Text::new(detail.clone(), (x - 8, detail_y), detail_style.clone()))
                .map_err(error)?;
        }
        if group.values.iter().all(Option::is_none) {
            root.draw(&Text::new("not run", (x + 8, y), not_run.clone())).map_err(error)?;
        }
    }
    root.present().map_err(error)?;
    Ok(())
}

/// One line of a line chart: its name and its points.
#[derive(Clone, Debug)]
pub struct Line {
    /// The legend's text.
    pub name: String,
    /// (x, y) points, in order of x.
    pub points: Vec<(f64, f64)>,
}

/// A line chart with a point at each value.
///
/// # Errors
/// When the file cannot be written or a drawing call fails.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    lines: &[Line],
) -> anyhow::Result<()> {
    register_font()?;
    let points = || lines.iter().flat_map(|l| l.points.iter());
    let x_max = points().fold(0.0_f64, |a, p| a.max(p.0)).max(1.0);
    let y_max = points().fold(0.0_f64, |a, p| a.max(p.1)).max(1.0);
    let root = BitMapBackend::new(path, (WIDTH, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max * 1.05, 0.0..y_max * 1.15)
        .map_err(error)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| short(*x))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(error)?;
    for (i, line) in lines.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(line.points.iter().copied(), colour.stroke_width(2)))
            .map_err(error)?
            .label(line.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
        chart
            .draw_series(line.points.iter().map(|&p| Circle::new(p, 4, colour.filled())))
            .map_err(error)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(error)?;
    root.present().map_err(error)?;
    Ok(())
}

/// 1500000 as "1.5M", 20000 as "20k".
fn short(x: f64) -> String {
    if x.abs() >= 1e6 {
        format!("{}M", trim(x / 1e6))
    } else if x.abs() >= 1e3 {
        format!("{}k", trim(x / 1e3))
    } else {
        trim(x)
    }
}

fn trim(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map_or(s.clone(), str::to_owned)
}

/// Part a's chart: publish and receive+ack per broker.
///
/// # Errors
/// As [`bar_chart`].
pub fn brokers(path: &Path, rows: &[BrokerRow]) -> anyhow::Result<()> {
    let groups: Vec<Group> = rows
        .iter()
        .map(|r| Group {
            label: r.system.clone(),
            // The table gives the whole of it; the figure has room for what comes before
            // the parenthesis.
            detail: Some(format!(
                "acknowledged when {}",
                r.durability.split(" (").next().unwrap_or(&r.durability)
            )),
            values: vec![r.publish, r.receive],
        })
        .collect();
    bar_chart(
        path,
        "Brokers: durable 1 KiB messages",
        "msg/s",
        &["publish", "receive + ack"],
        &groups,
    )
}

/// Part b's chart: per transport, the transport alone, the processor, the processor with
/// batches; pgbench's claim-only rate as a group of its own.
///
/// # Errors
/// As [`bar_chart`].
pub fn transports(path: &Path, t: &TransportsBench) -> anyhow::Result<()> {
    let mut groups: Vec<Group> = t
        .rows
        .iter()
        .map(|r| Group {
            label: r.transport.clone(),
            detail: Some(format!(
                "completed when {}",
                crate::results::transport_durability(&r.transport)
                    .split(" (")
                    .next()
                    .unwrap_or_default()
            )),
            values: vec![Some(r.consume), Some(r.processor), r.batches],
        })
        .collect();
    if let Some(tps) = t.pgbench_tps {
        groups.push(Group {
            label: "pgbench, the claim alone (tps)".to_owned(),
            detail: Some("each commit fsync'd".to_owned()),
            values: vec![None, Some(tps), None],
        });
    }
    let batches = format!("processor, batches of {}", t.batch);
    bar_chart(
        path,
        "The processor per transport (PostgreSQL inbox)",
        "msg/s",
        &["consume + complete", "processor", &batches],
        &groups,
    )
}

/// Part c's chart: p50 and p99 claim latency against the ids already in the inbox.
///
/// # Errors
/// As [`line_chart`].
#[allow(clippy::cast_precision_loss)] // reason: row counts and µs far below 2^52
pub fn claim(path: &Path, c: &ClaimBench) -> anyhow::Result<()> {
    let mut lines = Vec::new();
    for ids in ["random", "time-ordered"] {
        for (q, pick) in [("p50", 0), ("p99", 1)] {
            let points = c
                .points
                .iter()
                .filter(|p| p.ids == ids)
                .map(|p| (p.rows_before as f64, [p.p50_us, p.p99_us][pick] as f64))
                .collect();
            lines.push(Line { name: format!("{q}, {ids} ids"), points });
        }
    }
    line_chart(
        path,
        "Claim latency as the inbox grows (PostgreSQL)",
        "ids in the inbox",
        "µs",
        &lines,
    )
}

/// Part d's chart: fill and recovery in seconds per million messages.
///
/// # Errors
/// As [`bar_chart`].
pub fn recovery(path: &Path, r: &Recovery) -> anyhow::Result<()> {
    let groups = vec![
        Group {
            label: "fill".to_owned(),
            detail: Some("each send fsync'd (group commit)".to_owned()),
            values: vec![Some(r.fill_s_per_million())],
        },
        Group {
            label: "reopen (recovery)".to_owned(),
            detail: None,
            values: vec![Some(r.reopen_s_per_million())],
        },
    ];
    bar_chart(
        path,
        &format!("Durable broker, {} messages of 1 KiB", r.messages),
        "seconds per million messages",
        &["s per million"],
        &groups,
    )
}
