// `triaccel report RUN_DIR... -o report.html`: one self-contained HTML page (inline CSS, inline JS, the data as
// embedded JSON; it loads nothing from the network) with the charts of docs/report.md, and the side-by-side table as
// CSV beside it. A run whose events are missing, empty or damaged is shown with its problem in the page; only an
// empty run list or an output that cannot be written fails (UserError).
#pragma once

#include "triaccel/report/run_model.h"

#include <string>
#include <vector>

namespace triaccel {

struct ReportOptions {
  std::vector<std::string> runs;     // run folders (holding events.jsonl) or events files
  std::string html = "report.html";  // the page
  std::string csv;                   // the table; empty: the page's path with .csv for .html
  std::string title = "triaccel report";

  void validate() const;              // throws UserError naming the bad value and the fix
  std::string csv_path() const;
};

struct ReportResult {
  std::vector<RunModel> runs;
  std::string html_path, csv_path;
};

// Reads every run, builds the page and the CSV and writes both (each atomically).
ReportResult report_write(const ReportOptions& options);

// The page alone, for tests: the runs' data embedded as JSON and drawn by the inline script.
std::string report_html(const std::vector<RunModel>& runs, const std::string& title);

}  // namespace triaccel
