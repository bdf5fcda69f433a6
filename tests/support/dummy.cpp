// Keeps the test support library non-empty when tests/support has no other sources.
namespace trainrun_test_support_anchor { int anchor = 0; }
