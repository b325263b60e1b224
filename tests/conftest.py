"""Test-suite configuration: which parametrizations of the long tests run in the fast set.

``make test`` (CI's first step, the README's test command) must stay within 15 minutes on 2 cores; ``make test-slow``
(CI's second step) runs everything marked ``slow``. For each test function below, the fast set runs its first
parametrization and ``slow`` takes the rest: each took 4.5 s or more summed over its parametrizations in a full
``--durations=0`` run of the fast set (2026-12-01, 2-core VM: 2511 tests in 18:00 before, the list moved about
500 s of the 2050 s of test time). Add a function here when a new parametrization makes ``make test`` too long.
"""

from __future__ import annotations

import pytest

FIRST_PARAMETRIZATION_ONLY = frozenset({
    "tests/test_abstract_init.py::test_linen_jit_init_equals_eager_init",
    "tests/test_abstract_init.py::test_nnx_jit_and_eval_shape_build_the_eager_layer",
    "tests/test_abstract_init.py::test_sparsify_of_an_abstract_model_is_the_abstract_sparse_model",
    "tests/test_block_sparse_matmul.py::test_block_sizes",
    "tests/test_block_sparse_matmul.py::test_float64_result_of_float32_operands_accumulates_in_float64",
    "tests/test_block_sparse_matmul.py::test_patterns_and_dtypes",
    "tests/test_calibrated_embeddings.py::test_lookup_only_tables_reduce_to_magnitude",
    "tests/test_calibrated_embeddings.py::test_tied_tables_use_the_head_statistics_with_the_lookup_ridge",
    "tests/test_calibrated_pruning.py::test_calibrated_prune_masks_sparsify_to_the_same_function",
    "tests/test_calibrated_pruning.py::test_conv_patches_are_the_convolution",
    "tests/test_calibrated_pruning.py::test_float64_sparsegpt_and_refit_match_float64_references",
    "tests/test_calibrated_pruning.py::test_refit_matches_float64_least_squares",
    "tests/test_calibrated_pruning.py::test_sparsegpt_matches_float64_obs_reference",
    "tests/test_calibrated_pruning.py::test_sparsegpt_nm_whose_m_does_not_divide_block_size",
    "tests/test_calibrated_pruning_stacks.py::test_to_sparse_turns_a_pruned_stack_into_a_stack_of_sparse_layers",
    "tests/test_calibration_degenerate.py::test_layer_whose_inputs_a_relu_zeroes_is_pruned_by_magnitude_with_a_warning",
    "tests/test_checkpoint.py::test_sparse_nnx_checkpoint_restores_into_the_sparsified_abstract_model",
    "tests/test_cusparselt.py::test_buffer_storage_layer_equals_values_layer",
    "tests/test_cusparselt.py::test_sr_ste_matmul_custom_vjp_gives_the_reference_gradients",
    "tests/test_dtypes.py::test_linen_layers_match_flax",
    "tests/test_dtypes.py::test_nnx_linear_layers_match_nnx_linear",
    "tests/test_dtypes.py::test_ops_take_float8_like_jnp_matmul",
    "tests/test_embed.py::test_lookup_and_attend_equal_the_pruned_dense_embed",
    "tests/test_export.py::test_export_of_each_nnx_layer_kind_runs_the_same_forward_and_gradient",
    "tests/test_export.py::test_export_with_a_symbolic_batch_runs_every_layer_kind",
    "tests/test_export.py::test_export_with_a_symbolic_batch_runs_every_linen_layer_kind",
    "tests/test_export.py::test_export_with_the_safety_checks_runs_the_same_forward_and_gradient",
    "tests/test_faults.py::test_hand_built_index_arrays_are_validated",
    "tests/test_faults.py::test_linen_layer_called_with_other_feature_count",
    "tests/test_faults.py::test_pruner_view_of_qkv_kernels_is_sparsifys",
    "tests/test_faults.py::test_sparsify_under_eval_shape",
    "tests/test_files_boxed.py::test_boxed_linen_variables_save_unboxed_and_load_back",
    "tests/test_hand_built_indices_jit.py::test_nm_bad_positions_give_nan_in_their_group",
    "tests/test_hand_built_indices_jit.py::test_valid_block_sparse_built_in_jit_matches_dense",
    "tests/test_hand_built_indices_jit.py::test_valid_csr_built_in_jit_matches_dense",
    "tests/test_hand_built_indices_jit.py::test_valid_nm_built_in_jit_matches_dense",
    "tests/test_higher_order.py::test_second_order_bfloat16",
    "tests/test_higher_order.py::test_third_order_and_vmap",
    "tests/test_layers.py::test_from_dense_keeps_the_partitioning_names",
    "tests/test_layers.py::test_to_dense_keeps_the_partitioning_names",
    "tests/test_linen_compressed.py::test_compress_linen_outputs_equal_sparsify_linen",
    "tests/test_linen_compressed.py::test_layer_output_equals_nm_dense",
    "tests/test_linen_embed.py::test_lookup_and_attend_equal_nn_embed_on_the_pruned_table",
    "tests/test_llama.py::test_sparse_model_generates_dense_tokens",
    "tests/test_llama_decode_attention.py::test_decode_attention_matches_eager_attention",
    "tests/test_named_layers.py::test_linen_torch_export_of_named_layers_reads_their_boxes",
    "tests/test_nm.py::test_sr_ste_forward_and_gradient_formula",
    "tests/test_nm.py::test_sr_ste_transposable_forward_gradient_and_matmul",
    "tests/test_nm_layers.py::test_nm_matmul_keeps_preferred_element_type_digits",
    "tests/test_nm_restore_mismatch.py::test_linen_orbax_restore",
    "tests/test_nm_restore_mismatch.py::test_nnx_orbax_restore_raises_before_jit",
    "tests/test_ops_sharding.py::test_ops_inside_shard_map_with_check_vma",
    "tests/test_pallas_block_sparse.py::test_interpret_matches_dense",
    "tests/test_pallas_block_sparse.py::test_interpret_mid_size_default_config",
    "tests/test_pallas_block_sparse.py::test_mosaic_kernels_read_a_ragged_last_row_tile_without_padding",
    "tests/test_pallas_block_sparse_sdd_mgpu.py::test_dense_then_gather_dw_product_in_the_weight_dtype",
    "tests/test_pallas_block_sparse_sdd_mgpu.py::test_items_rebuild_the_sampled_product",
    "tests/test_pallas_nm.py::test_interpret_matches_dense",
    "tests/test_pruning.py::test_apply_masks_narrows_the_sparsity_masks_of_linen_variables",
    "tests/test_pruning.py::test_schedules_are_exact_for_integer_steps_past_2_24",
    "tests/test_pruning_already_sparse.py::test_a_rule_looser_than_the_layer_keeps_the_layer_and_warns",
    "tests/test_pruning_already_sparse.py::test_an_all_true_layer_mask_changes_nothing",
    "tests/test_seams_tp_block_prune.py::test_compress_of_a_stack_compresses_each_layer",
    "tests/test_seams_tp_block_prune.py::test_pruners_refuse_the_kept_blocks_of_a_block_sparse_layer",
    "tests/test_seams_tp_block_prune.py::test_tensor_parallel_layer_is_summarized_densified_and_refused_by_the_pruners",
    "tests/test_sparse_matmul.py::test_block_sparse_cpu_kernels_match_dense",
    "tests/test_sparse_matmul.py::test_forward_row_blocks_follow_the_density",
    "tests/test_sparse_matmul.py::test_masked_linear_cpu_matches_xla",
    "tests/test_sparse_matmul.py::test_masks_and_dtypes",
    "tests/test_sparse_matmul.py::test_sparse_matmul_auto_picks_the_dense_route_by_density",
    "tests/test_sparse_matmul.py::test_sparse_matmul_few_rows_stream_the_entries",
    "tests/test_sparse_matmul.py::test_vmap",
    "tests/test_sparsify_linen_general.py::test_nnx_and_linen_attention_agree",
    "tests/test_sparsify_linen_general.py::test_sparsegpt_masks_make_the_sparse_attention_block",
    "tests/test_sparsify_linen_scan.py::test_stacks_of_dense_general_and_conv_layers",
    "tests/test_sparsify_seams.py::test_bridge_to_nnx_of_a_sparsify_linen_model",
    "tests/test_sparsify_seams.py::test_stacked_scan_over_layers_kernels_nnx_and_linen_sparsified",
    "tests/test_sparsify_stacks.py::test_stack_becomes_the_stack_of_its_sparse_layers",
    "tests/test_torch_interop.py::test_gpt2_conv1d_module_load_nnx_and_export",
    "tests/test_transforms.py::test_linen_remat_and_jit_match_plain",
    "tests/test_transforms.py::test_linen_scan_with_sparsity_axes_matches_each_step",
    "tests/test_transforms.py::test_linen_scan_without_sparsity_axes_says_how",
    "tests/test_transforms.py::test_nnx_scan_over_stack_matches_dense_layers",
    "tests/test_transforms_seams.py::test_bfloat16_ensemble_of_compressed_layers_trains_on_cpu",
    "tests/test_transforms_seams.py::test_linen_vmap_ensemble",
    "tests/test_transforms_seams.py::test_stack_called_outside_a_transform_says_how",
    "tests/test_transforms_seams.py::test_vmap_over_a_non_leading_batch_axis",
    "tests/test_tuning.py::test_every_route_matches_the_reference",
    "tests/test_tuning.py::test_gpu_route_retiles_and_matches_the_reference",
    "tests/test_tuning.py::test_split_blocks_is_the_same_matrix",
})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
  del config
  seen = set()
  for item in items:
    name = item.nodeid.split("[", 1)[0]
    if name not in FIRST_PARAMETRIZATION_ONLY or not hasattr(item, "callspec"):
      continue
    if name in seen:
      item.add_marker(pytest.mark.slow)
    seen.add(name)
