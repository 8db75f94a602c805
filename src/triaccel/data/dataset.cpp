#include "triaccel/data/dataset.h"
