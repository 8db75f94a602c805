// The side-by-side table of runs as CSV (the page shows the same rows): one header line, one line per run, in the
// order given. Numbers are printed with 6 significant digits; an unknown figure is an empty cell.
#pragma once

#include "triaccel/report/run_model.h"

#include <string>
#include <vector>

namespace triaccel {

constexpr const char* kTableCsvHeader =
    "run,method,model,dataset,precision,epochs,test_acc_pct,epoch_s,peak_vram_gb,eff_score,source,ranks";

std::string table_csv(const std::vector<RunModel>& runs);

}  // namespace triaccel
