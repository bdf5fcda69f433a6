// placeholder; the CLI is written next.
int main() { return 0; }
