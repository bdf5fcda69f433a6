// Moved to core/common/debug_hooks.h (parallel/ uses the hooks too, and it
// may not include core/launch). Kept one release so that branches written
// against the old path still build; include the new one.
#pragma once
#include "core/common/debug_hooks.h"
