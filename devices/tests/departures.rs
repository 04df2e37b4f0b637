//! The departures of the `gpualloc` policy from PyTorch's rules are written once
//! (`gpualloc_devices::policy::DEVIATIONS`); the README shows them as
//! `deviations_table` renders them, and this test keeps the two the same.

use gpualloc_devices::policy::{deviations_table, DEVIATIONS};

const README: &str = include_str!("../../README.md");

#[test]
fn the_readme_shows_the_departures_table_as_written_in_the_code() {
    let table = deviations_table();
    assert_eq!(
        table.lines().count(),
        2 + DEVIATIONS.len(),
        "a header, a rule line, one row per departure"
    );
    assert!(
        README.contains(&table),
        "README.md's departures table differs from policy::DEVIATIONS; put this in the \
         README (or change DEVIATIONS):\n\n{table}"
    );
    // And only once: no second, older copy.
    assert_eq!(
        README
            .matches("| rule | PyTorch | gpualloc | why | effect |")
            .count(),
        1
    );
}

#[test]
fn every_departure_says_all_five_things() {
    for d in DEVIATIONS {
        for (what, text) in [
            ("rule", d.rule),
            ("pytorch", d.pytorch),
            ("gpualloc", d.gpualloc),
            ("why", d.why),
            ("evidence", d.evidence),
        ] {
            assert!(text.len() > 10, "{}: {what} is empty", d.rule);
            assert!(
                !text.contains('|'),
                "{}: {what} would break the table",
                d.rule
            );
            assert!(
                !text.contains("  "),
                "{}: {what} has a double space",
                d.rule
            );
        }
    }
}
