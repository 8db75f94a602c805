#include <ATen/ATen.h>
