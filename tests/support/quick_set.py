"""The quick end-to-end set (tests/conftest.py marks its tests `quick`)."""

# The README's first test command runs the unit tests and these end-to-end tests: every area
# at least once (kernel messages, widgets, magics, fork, egress, files, restart, the channel's
# recovery, the engine, isolation attacks, limits, the vendor SDK, subshells, the debugger, the
# pool, ownership, early start, papermill, a terminal and a browser frontend, what reaches the
# page, a fork's agent, transitions and shutdown), so that one
# change can be checked in minutes. The second command runs every other end-to-end test.
QUICK = frozenset({
    "tests/e2e/test_kernel_messages.py::test_state_persists_and_execute_result_counts",
    "tests/e2e/test_early_cell.py::test_a_cell_sent_ahead_runs_once_on_its_count_after_its_execute_input",
    "tests/e2e/test_kernel_messages.py::test_interrupt_stops_a_busy_loop",
    "tests/e2e/test_kernel_messages.py::test_input_and_getpass_use_the_stdin_channel",
    "tests/e2e/test_kernel_messages.py::test_matplotlib_figure_is_an_inline_png",
    "tests/e2e/test_protocol_fidelity.py::test_a_slider_moved_in_the_frontend_reaches_its_observer",
    "tests/e2e/test_magics.py::test_pause_resume_keeps_state",
    "tests/e2e/test_magics.py::test_misuse_is_one_line_and_the_kernel_lives",
    "tests/e2e/test_fork_notebook.py::test_fork_in_a_notebook",
    "tests/e2e/test_fork.py::test_fork_copies_then_diverges_and_outlives_its_parent",
    "tests/e2e/test_egress.py::test_rules_let_through_only_what_they_name",
    "tests/e2e/test_transfer_magics.py::test_upload_and_download_files_and_directories",
    "tests/e2e/test_kernel_lifecycle.py::test_restart_is_a_fresh_runner_in_the_same_sandbox",
    "tests/e2e/test_channel.py::test_a_relay_killed_from_a_cell_is_replaced_and_the_runner_kept",
    "tests/e2e/test_reconnect.py::test_dropped_stream_resumes_without_loss_or_duplicates[channel]",
    "tests/local/test_engine_restart.py::test_a_killed_engine_takes_nothing_from_the_notebook[local engine]",
    "tests/local/test_engine_lifecycle.py::test_pause_resume_keeps_state",
    "tests/security/test_attacks.py::test_host_secrets_are_unreadable",
    "tests/security/test_attacks.py::test_host_loopback_and_engine_api_are_unreachable",
    "tests/security/test_magic_line_attacks.py::test_the_sandbox_cannot_write_the_magic_line",
    "tests/security/test_files_escape.py::test_symlinks_in_the_workspace_resolve_inside",
    "tests/security/test_output_floods.py::test_output_forged_past_the_runner_is_capped_by_the_kernel",
    "tests/local/test_limits.py::test_seccomp_blocks_dangerous_calls_with_eperm",
    "tests/peers/test_vendor_sdk.py::test_the_everyday_methods_work",
    "tests/e2e/test_subshells.py::test_two_subshells_run_together_each_output_on_its_request",
    "tests/e2e/test_debugger.py::test_a_breakpoint_in_a_cell_stops_it_with_its_locals",
    "tests/sandbox/test_pool.py::test_kernels_start_on_pooled_sandboxes_never_the_same_one_and_the_pool_refills",
    "tests/sandbox/test_ownership.py::test_the_tour_leaves_no_sandbox_behind",
    "tests/sandbox/test_early_start.py::test_the_session_drives_the_sandbox_made_early",
    "tests/e2e/test_papermill.py::test_papermill_injects_parameters",
    "tests/e2e/test_console.py::test_jupyter_console_runs_cells",
    "tests/browser/test_browser.py::test_jupyterlab_runs_a_cell_that_prints_and_plots",
    "tests/security/test_output_attacks.py::test_output_that_would_run_in_the_page_is_withheld_or_isolated",
    "tests/security/test_agent_socket_attacks.py::test_a_socket_planted_in_the_fork_does_not_answer_for_its_agent",
    "tests/e2e/test_transition_races.py::test_a_cell_sent_while_the_sandbox_pauses_runs_once_it_can",
    "tests/e2e/test_shutdown_replies.py::test_a_cell_sent_while_the_kernel_shuts_down_is_answered[started0]",
})
