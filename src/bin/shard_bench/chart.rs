//! W2 as a picture: latency and throughput over time, per interval, with
//! the kill, the Down and the last rehome marked (SVG, drawn by plotters).

use std::path::Path;
use std::time::Duration;

use hdrhistogram::Histogram;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// One interval of the run: the logical asks acked in it and their
/// latency (first attempt to ack, retries included).
#[derive(Debug)]
pub struct Interval {
    /// The interval's start, seconds since the run started.
    pub start_s: f64,
    pub acks: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

/// Cuts a timeline of `(acked at µs, latency µs)` into intervals of `width`
/// (an interval with no ack is kept, with zeros: the chart shows the gap).
pub fn intervals(timeline: &[(u64, u64)], width: Duration) -> Vec<Interval> {
    let Some(end) = timeline.iter().map(|(at, _)| *at).max() else {
        return Vec::new();
    };
    intervals_to(timeline, width, end)
}

/// [`intervals`] up to `end` µs (so two timelines cut alike line up).
pub fn intervals_to(timeline: &[(u64, u64)], width: Duration, end: u64) -> Vec<Interval> {
    let width_us = width.as_micros().max(1) as u64;
    let end = timeline.iter().map(|(at, _)| *at).fold(end, u64::max);
    let count = (end / width_us + 1) as usize;
    let mut histograms: Vec<Histogram<u64>> = (0..count)
        .map(|_| Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"))
        .collect();
    for &(at, latency) in timeline {
        histograms[(at / width_us) as usize].saturating_record(latency.max(1));
    }
    histograms
        .iter()
        .enumerate()
        .map(|(i, h)| Interval {
            start_s: (i as u64 * width_us) as f64 / 1e6,
            acks: h.len(),
            p50_us: if h.is_empty() {
                0
            } else {
                h.value_at_quantile(0.5)
            },
            p99_us: if h.is_empty() {
                0
            } else {
                h.value_at_quantile(0.99)
            },
            max_us: h.max(),
        })
        .collect()
}

/// A latency line: its label, colour and the value it shows.
type Series = (&'static str, RGBColor, fn(&Interval) -> u64);

/// The events marked on the chart, seconds since the run started.
pub struct Marks {
    pub kill_s: f64,
    pub down_s: f64,
    pub rehomed_s: Option<f64>,
}

impl Marks {
    /// Each mark's label, colour and time (the last rehome may be absent).
    fn drawn(&self) -> [(&'static str, RGBColor, Option<f64>); 3] {
        [
            ("kill", BLACK, Some(self.kill_s)),
            ("Down", MAGENTA, Some(self.down_s)),
            ("last rehome", RGBColor(0, 150, 0), self.rehomed_s),
        ]
    }
}

type Area<'b> = DrawingArea<SVGBackend<'b>, plotters::coord::Shift>;
type LatencyChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, LogCoord<f64>>>;
type RateChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;
type Drawn = Result<(), Box<dyn std::error::Error>>;

/// The upper chart: latency on a log scale up to `top` µs, with the marks.
fn latency_chart<'a, 'b>(
    area: &'a Area<'b>,
    title: &str,
    y_desc: &str,
    (t_end, top): (f64, f64),
    marks: &Marks,
) -> Result<LatencyChart<'a, 'b>, Box<dyn std::error::Error>> {
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..t_end, (1f64..top).log_scale())?;
    chart
        .configure_mesh()
        .y_desc(y_desc)
        .x_desc("seconds since the run started")
        .draw()?;
    for (label, color, at) in marks.drawn() {
        if let Some(at) = at {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(at, 1.0), (at, top)],
                    color.stroke_width(1),
                )))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
    }
    Ok(chart)
}

/// The lower chart: acks per second up to `peak`, with the marks.
fn rate_chart<'a, 'b>(
    area: &'a Area<'b>,
    (t_end, peak): (f64, f64),
    marks: &Marks,
) -> Result<RateChart<'a, 'b>, Box<dyn std::error::Error>> {
    let peak = peak.max(1.0);
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..t_end, 0f64..peak)?;
    chart
        .configure_mesh()
        .y_desc("acks per second")
        .y_label_formatter(&|v| format!("{:.0}k", v / 1e3))
        .draw()?;
    for (_, color, at) in marks.drawn() {
        if let Some(at) = at {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(at, 0.0), (at, peak)],
                color.stroke_width(1),
            )))?;
        }
    }
    Ok(chart)
}

/// Draws one latency line per run of intervals with acks: no line is
/// drawn across an interval in which nothing was acked (there is no
/// latency to show); a lone interval between gaps is a dot.
fn latency_line(
    chart: &mut LatencyChart<'_, '_>,
    intervals: &[Interval],
    (label, color, value): (String, RGBColor, fn(&Interval) -> u64),
) -> Drawn {
    let runs = intervals
        .split(|i| i.acks == 0)
        .filter(|run| !run.is_empty());
    for (n, run) in runs.enumerate() {
        let drawn = chart.draw_series(LineSeries::new(
            run.iter().map(|i| (i.start_s, value(i).max(1) as f64)),
            color.stroke_width(2),
        ))?;
        if n == 0 {
            drawn
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        if let [i] = run {
            chart.draw_series(std::iter::once(Circle::new(
                (i.start_s, value(i).max(1) as f64),
                3,
                color.filled(),
            )))?;
        }
    }
    Ok(())
}

/// Draws acks per second over the full intervals (the last one is cut
/// short by the end of the run: left out).
fn rate_line(
    chart: &mut RateChart<'_, '_>,
    intervals: &[Interval],
    per_s: f64,
    (label, color): (&'static str, RGBColor),
) -> Drawn {
    let full = &intervals[..intervals.len().saturating_sub(1)];
    chart
        .draw_series(LineSeries::new(
            full.iter().map(|i| (i.start_s, i.acks as f64 * per_s)),
            color.stroke_width(2),
        ))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    Ok(())
}

/// A chart's legend, framed, at `position`.
fn legend<'a, 'b: 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, CT>,
    position: SeriesLabelPosition,
) -> Drawn {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Draws the chart: latency (log scale) above, throughput below.
pub fn draw(
    path: &Path,
    title: &str,
    intervals: &[Interval],
    width: Duration,
    marks: &Marks,
) -> Drawn {
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(400);
    let t_end = intervals.last().map_or(1.0, |i| i.start_s) + width.as_secs_f64();
    let top = intervals
        .iter()
        .map(|i| i.max_us)
        .max()
        .unwrap_or(1)
        .max(10) as f64
        * 2.0;
    let mut latency = latency_chart(&upper, title, "latency, µs (log)", (t_end, top), marks)?;
    let series: [Series; 3] = [
        ("p50", BLUE, |i| i.p50_us),
        ("p99", RGBColor(230, 120, 0), |i| i.p99_us),
        ("max", RED, |i| i.max_us),
    ];
    for (label, color, value) in series {
        latency_line(&mut latency, intervals, (label.to_owned(), color, value))?;
    }
    legend(&mut latency, SeriesLabelPosition::UpperRight)?;
    let per_s = 1.0 / width.as_secs_f64();
    let peak = intervals.iter().map(|i| i.acks).max().unwrap_or(1) as f64 * per_s * 1.1;
    let mut rate = rate_chart(&lower, (t_end, peak), marks)?;
    rate_line(&mut rate, intervals, per_s, ("acks per second", BLUE))?;
    root.present()?;
    Ok(())
}

/// An open-loop W2's intervals, for the entities that lived on the killed
/// node and for the rest, cut alike.
pub struct Split {
    pub affected: Vec<Interval>,
    pub rest: Vec<Interval>,
}

/// Draws the open loop: each group's p99 latency (log scale) above, its
/// acks per second below, with the same marks as [`draw`].
pub fn draw_split(
    path: &Path,
    title: &str,
    split: &Split,
    width: Duration,
    marks: &Marks,
) -> Drawn {
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(360);
    let longest = split.rest.len().max(split.affected.len());
    let t_end = longest as f64 * width.as_secs_f64();
    let all = || split.affected.iter().chain(&split.rest);
    let top = all().map(|i| i.p99_us).max().unwrap_or(1).max(10) as f64 * 2.0;
    let groups = [
        ("entities on the killed node", RED, &split.affected),
        ("the other entities", BLUE, &split.rest),
    ];
    let mut latency = latency_chart(&upper, title, "p99 latency, µs (log)", (t_end, top), marks)?;
    for (label, color, intervals) in groups {
        let p99: fn(&Interval) -> u64 = |i| i.p99_us;
        latency_line(
            &mut latency,
            intervals,
            (format!("p99, {label}"), color, p99),
        )?;
    }
    legend(&mut latency, SeriesLabelPosition::UpperLeft)?;
    let per_s = 1.0 / width.as_secs_f64();
    let peak = all().map(|i| i.acks).max().unwrap_or(1) as f64 * per_s * 1.1;
    let mut rate = rate_chart(&lower, (t_end, peak), marks)?;
    for (label, color, intervals) in groups {
        rate_line(&mut rate, intervals, per_s, (label, color))?;
    }
    legend(&mut rate, SeriesLabelPosition::UpperRight)?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_bucket_by_ack_time_and_keep_gaps() {
        let timeline = [(0, 10), (5_000, 30), (25_000, 100)];
        let cut = intervals(&timeline, Duration::from_millis(10));
        assert_eq!(cut.len(), 3);
        assert_eq!((cut[0].acks, cut[0].max_us), (2, 30));
        assert_eq!(cut[1].acks, 0, "the gap stays");
        assert_eq!((cut[2].acks, cut[2].p50_us), (1, 100));
        assert!((cut[2].start_s - 0.02).abs() < 1e-9);
    }
}
