// The page's inline stylesheet and script, compiled in from page.css and page.js (CMake writes page_assets.cpp from
// page_assets.cpp.in at configure time, so editing either file rebuilds the binary).
#pragma once

namespace triaccel {

extern const char* const kReportPageCss;
extern const char* const kReportPageJs;

}  // namespace triaccel
