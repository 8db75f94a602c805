#include "triaccel/models/model.h"
